"""The command line of `python -m flows.<name> CONFIG.yaml [--set field=value ...]`, in a module that imports
neither Prefect nor the flows: `python -m flows.train` takes the run's lock with it before importing them, so a twin
of a live run is refused in seconds on a loaded machine."""

from __future__ import annotations

import argparse
import sys

from lightning import owner
from lightning.config_file import apply_overrides, named_run, parse_overrides, read_config_file
from lightning.errors import ConfigError


def flow_arguments(flow_name: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{flow_name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="a YAML file of TrainConfig fields (see examples/copy_task/demo.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field (dotted)")
    return parser


def take_the_run(argv: list[str]) -> owner.RunLock | None:
    """The lock of the run these arguments name (`lightning.owner`), taken for this command before Prefect is imported;
    exit with one line if a live process trains that run. None when the arguments name no run (a bad config, --help:
    the command itself says so)."""
    try:
        args, _ = flow_arguments("train", None).parse_known_args(argv)
        # The config as data (the library is not imported yet: on a loaded machine that takes seconds).
        run_dir, run_name = named_run(apply_overrides(read_config_file(args.config), parse_overrides(args.set)))
        return owner.acquire(run_dir, run_name)
    except owner.RunLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ConfigError, SystemExit):
        return None
