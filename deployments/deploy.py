"""Deploy every deployment in prefect.yaml (after `deployments.setup`), without prompts.

    python -m deployments.deploy                      # against PREFECT_API_URL, from this checkout
    prefect worker start --pool lightning-process     # where the checkout is: runs the deployments' flow runs

The flow runs' working directory is this checkout, or $LIGHTNING_REPO if set (see prefect.yaml's build step).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from deployments.setup import main as setup

REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m deployments.deploy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    setup([])
    # prefect.yaml's build step records the directory it runs in as the flow runs' working directory.
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    raise SystemExit(subprocess.run(command, cwd=REPO_ROOT).returncode)


if __name__ == "__main__":
    main()
