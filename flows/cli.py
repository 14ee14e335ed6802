"""`python -m flows.<name> CONFIG.yaml [--set field=value ...]`: run a flow on a config file from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import yaml

from lightning.config import ConfigError, load_config


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`algorithm.lr=1e-4` -> {"algorithm.lr": 0.0001}; values are read as YAML (numbers, booleans, lists)."""
    overrides = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set {pair!r}: write field=value, e.g. --set algorithm.lr=1e-4")
        overrides[name] = yaml.safe_load(text)
    return overrides


def run_flow_cli(flow: Any, argv: list[str] | None, description: str | None) -> Any:
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{flow.name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="a YAML file of TrainConfig fields (see examples/copy_task/demo.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field (dotted)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, **parse_overrides(args.set))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    result = asyncio.run(flow(config))
    print(json.dumps(result, indent=2, default=str))
    if isinstance(result, dict) and "reward_after" in result:
        print(where_to_look(config, result))
    return result


def where_to_look(config: Any, summary: dict[str, Any]) -> str:
    """The end of a training run on the command line: the reward before and after, and where the details are."""
    before, after = summary["reward_before"], summary["reward_after"]
    warm = f"{summary['reward_initial']:.3f} initially, " if config.warm_start is not None else ""
    start = "after the warm start" if config.warm_start is not None else "before training"
    return (
        f"\nHeld-out reward of {summary['run_name']}: {warm}{before:.3f} {start}, {after:.3f} after "
        f"{summary['iterations']} iterations of RL.\n"
        f"  checkpoint:  {summary['checkpoint']}\n"
        f"  Prefect UI:  .venv/bin/prefect server start   then open http://127.0.0.1:4200/runs "
        f"(flow run {config.run_name!r})\n"
        f"  MLflow UI:   LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/mlflow ui --backend-store-uri "
        f"{config.tracking_uri}   then open http://127.0.0.1:5000\n"
    )
