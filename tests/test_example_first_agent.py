"""The README's first agent, as a new user runs it: its config checks, and `flows.dev` dry-runs it end to end
(rollouts through the proxy into the store, the adapter) from the command line."""

from __future__ import annotations

import json
import re
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


def run_flow(flow: str, tmp_path: Path, *sets: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m flows.<flow> examples/first_agent/config.yaml --set ...`, its store, MLflow and runs in tmp_path."""
    where = [f"store_url=sqlite:///{tmp_path}/store.db", f"tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    command = [sys.executable, "-m", f"flows.{flow}", CONFIG]
    for override in [*where, f"output_dir={tmp_path}/runs", *sets]:
        command += ["--set", override]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def result_of(done: subprocess.CompletedProcess[str]) -> dict:
    return json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{") :])[0]


def test_the_demonstrations_are_the_answers_as_the_template_renders_them() -> None:
    from examples.first_agent.agent import demonstrations
    from lightning.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    [row] = demonstrations(tokenizer, [{"word": "delta"}])
    assert tokenizer.decode(row.prompt).endswith("First letter of delta?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(row.response) == ["d", "<|im_end|>"] and row.reward == 1.0


@pytest.mark.slow
def test_the_dev_flow_dry_runs_it(tmp_path: Path) -> None:
    result = result_of(run_flow("dev", tmp_path))
    assert result["rollouts"]["rollouts"] == result["rollouts"]["succeeded"] == 8 * 4
    assert result["batch"]["rows"] == 8 * 4 and result["batch"]["adapter"]["calls_without_token_ids"] == 0


@pytest.mark.slow
def test_the_readme_trains_it_and_evaluates_the_latest_checkpoint(tmp_path: Path) -> None:
    """`python -m flows.train CONFIG --set iterations=5 --set algorithm.lr=5e-4` (one iteration here), then
    `python -m flows.evaluate CONFIG`."""
    trained = run_flow("train", tmp_path, "iterations=1", "algorithm.lr=5e-4")
    summary = result_of(trained)
    assert summary["iterations"] == 1 and summary["checkpoint"].endswith("step-000001")
    assert "Held-out reward of first-agent" in trained.stdout and "View at" not in trained.stderr
    evaluated = result_of(run_flow("evaluate", tmp_path))
    assert evaluated["step"] == 1 and evaluated["rollouts"] == 18  # the 18 held-out tasks, on checkpoint 1


@pytest.mark.slow
def test_what_the_agent_raised_reaches_the_terminal(tmp_path: Path) -> None:
    """A sampling parameter the backends take but the OpenAI SDK refuses as a keyword (vLLM's top_k: the SDK wants
    it in extra_body) passes `config check` (the agent's business); every rollout then fails, and the error that
    ends the run says what the agent raised and where, not only that it did."""
    done = run_flow("dev", tmp_path, "sampling={top_k: 4}", "rollout_retries=0", check=False)
    assert done.returncode != 0
    # The command's last line says it: the first error the agent raised.
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(
        r"error: RolloutsFailed: iteration \d+: 0 of 32 rollouts succeeded, .*: the agent raised TypeError", last
    )
    assert re.search(r"TypeError: .*top_k.* \(at examples/first_agent/agent\.py:\d+ in first_letter\)", done.stderr)
