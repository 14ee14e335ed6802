"""The README's first agent, as a new user runs it: its config checks, and `flows.dev` dry-runs it end to end
(rollouts through the proxy into the store, the adapter) from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = "examples/first_agent/config.yaml"


def test_the_config_checks() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning.cli", "config", "check", CONFIG],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_the_dev_flow_dry_runs_it(tmp_path: Path) -> None:
    overrides = [
        f"store_url=sqlite:///{tmp_path}/store.db",
        f"tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"output_dir={tmp_path}/runs",
    ]
    command = [sys.executable, "-m", "flows.dev", CONFIG]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["rollouts"]["rollouts"] == result["rollouts"]["succeeded"] == 8 * 4
    assert result["batch"]["rows"] == 8 * 4 and result["batch"]["adapter"]["calls_without_token_ids"] == 0
