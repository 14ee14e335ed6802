"""Serve the train, evaluate and dev flows from this process, for trying the flows without a work pool or a
worker: the deployments `train/local`, `evaluate/local` and `dev/local` run their flow runs here until Ctrl-C.

    python -m deployments.serve [CONFIG.yaml]     # then: prefect deployment run 'train/local', or the UI
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml
from prefect import serve

from flows.dev import dev
from flows.evaluate import evaluate
from flows.train import train
from lightning.config import load_config

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "examples" / "copy_task" / "demo.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default=str(DEMO), help="the deployments' default TrainConfig (YAML)")
    args = parser.parse_args(argv)
    load_config(args.config)  # a bad config fails here, not in the first flow run
    parameters = {"config": yaml.safe_load(Path(args.config).read_text())}
    # Relative paths in a config mean the same as in the deployments of prefect.yaml: relative to the checkout.
    os.chdir(REPO_ROOT)
    serve(
        train.to_deployment(name="local", parameters=parameters),
        evaluate.to_deployment(name="local", parameters=parameters),
        dev.to_deployment(name="local", parameters=parameters),
    )


if __name__ == "__main__":
    main()
