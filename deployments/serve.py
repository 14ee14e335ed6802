"""Serve the deployments of prefect.yaml from this process, for trying the flows without a work pool or a worker:
the same deployments (`train/demo`, `train/nightly`, `evaluate/evaluate`, `dev/dev`, `optimize_prompt/room-booking`),
with the same parameters and schedules, run their flow runs here until Ctrl-C. prefect.yaml is the one list of
them: a flow deployed there is served here.

    python -m deployments.serve                  # then: prefect deployment run 'train/demo', or the UI
    python -m deployments.serve CONFIG.yaml      # every served deployment gets CONFIG as its `config`
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml
from prefect import serve
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron

from lightning.config import load_config

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO_ROOT / "prefect.yaml"


def deployments(config: dict[str, Any] | None = None) -> list[Any]:
    """prefect.yaml's deployments, to serve from this process (no work pool); `config`, if given, replaces each
    one's `config` parameter."""
    served = []
    for spec in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]:
        flow = load_flow_from_entrypoint(str(REPO_ROOT / spec["entrypoint"]))
        parameters = dict(spec.get("parameters") or {})
        if config is not None:
            parameters["config"] = config
        schedules = [
            Cron(each["cron"], timezone=each.get("timezone"), active=each.get("active", True))
            for each in spec.get("schedules") or []
        ]
        deployment = flow.to_deployment(
            name=spec["name"], parameters=parameters, description=spec.get("description"), schedules=schedules
        )
        served.append(deployment)
    return served


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "config", nargs="?", default=None, help="a TrainConfig (YAML) every deployment gets (default: prefect.yaml's)"
    )
    args = parser.parse_args(argv)
    config = None
    if args.config is not None:
        load_config(args.config)  # a bad config fails here, not in the first flow run
        config = yaml.safe_load(Path(args.config).read_text())
    served = deployments(config)
    # Relative paths in a config mean the same as in the deployments of prefect.yaml: relative to the checkout.
    os.chdir(REPO_ROOT)
    # A stopped server leaves the deployments as they were (Prefect would pause them: `train/demo` then stayed paused
    # after a SIGTERM, and its runs and schedules waited).
    serve(*served, pause_on_shutdown=False)


if __name__ == "__main__":
    main()
