"""The command line of `python -m flows.<name> CONFIG.yaml [--set field=value ...]`, in a module that imports
neither Prefect nor the flows: `python -m flows.train` refuses a twin of a live run with it before importing them
(seconds on a loaded machine)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from lightning.config import ConfigError, load_config


def flow_arguments(flow_name: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{flow_name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="a YAML file of TrainConfig fields (see examples/copy_task/demo.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field (dotted)")
    return parser


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`algorithm.lr=1e-4` -> {"algorithm.lr": 0.0001}; values are read as YAML (numbers, booleans, lists)."""
    overrides = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set {pair!r}: write field=value, e.g. --set algorithm.lr=1e-4")
        overrides[name] = yaml.safe_load(text)
    return overrides


def refuse_a_twin(argv: list[str]) -> None:
    """Exit with one line if a live process trains the run these arguments name (`lightning.owner`); anything
    else (a bad config, --help) is left to the command itself, which takes the lock."""
    from lightning import owner

    try:
        args, _ = flow_arguments("train", None).parse_known_args(argv)
        config = load_config(args.config, **parse_overrides(args.set))
        owner.check_owner(config.run_dir, config.run_name)
    except owner.RunLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ConfigError, SystemExit):
        return
