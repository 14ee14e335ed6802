"""agent-lightning's `Trainer(...).fit(...)` and `.dev(...)` on an agent written for agent-lightning 0.3 with only its
imports changed (tests/support/agl_letter_agent.py): they run our `train` and `dev` flows (Prefect's test server,
the tiny model on the embedded inference server, a SQLite store file, MLflow in SQLite)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.agl_letter_agent import LetterAgent, letter_tasks

import lightning as agl
from lightning.checkpoint import latest_checkpoint
from lightning.store import SqlLightningStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    with prefect_test_harness(server_startup_timeout=180):
        yield


def tiny_run(tmp_path: Path, run_name: str) -> dict[str, Any]:
    """TrainConfig fields of a run that takes seconds: a few rollouts of at most 2 tokens."""
    return {
        "run_name": run_name,
        "iterations": 1,
        "batch_size": 4,
        "samples_per_task": 2,
        "runner_concurrency": 8,
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2},
        "max_prompt_length": 64,
        "max_response_length": 4,
        "checkpoint": {"keep_last": 2, "log_every": 1},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }


async def rollouts_of(store_url: str, queue: str) -> list[Any]:
    async with SqlLightningStore(store_url, watchdog_interval=None) as store:
        return list(await store.query_rollouts(queue=queue))


async def reward_spans(store_url: str, rollout_id: str) -> list[Any]:
    async with SqlLightningStore(store_url, watchdog_interval=None) as store:
        return [span for span in await store.query_spans(rollout_id) if span.name == "lightning.reward"]


def test_fit_trains_an_agent_lightning_agent_through_the_train_flow(tmp_path: Path) -> None:
    agent = LetterAgent()
    algorithm = {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64}
    trainer = agl.Trainer(n_runners=1, algorithm=algorithm, **tiny_run(tmp_path, "agl-fit"))
    tasks = letter_tasks()
    summary = trainer.fit(agent, tasks, val_dataset=tasks[:4])

    assert agent.trainer is trainer and agent.trained_agents == "answer"
    assert trainer.config is not None and trainer.config.agent.startswith("lightning.trainer:registry.")
    assert summary["run_name"] == "agl-fit" and summary["iterations"] == 1
    assert 0 <= summary["reward_before"] <= 1 and 0 <= summary["reward_after"] <= 1
    checkpoint = latest_checkpoint(trainer.config.run_dir / "checkpoints")
    assert checkpoint is not None and summary["checkpoint"] == str(checkpoint)

    rollouts = asyncio.run(rollouts_of(trainer.config.store_url, "agl-fit"))
    train = [r for r in rollouts if r.mode == "train"]
    assert len(train) == 4 * 2 and {r.status for r in train} == {"succeeded"}
    # Its dict of rewards with keywords, then its bool: both reward spans, the bool's the final one.
    emitted, returned = asyncio.run(reward_spans(trainer.config.store_url, train[0].rollout_id))
    assert emitted.attributes["lightning.reward.primary_key"] == "correct" and "answer_chars" in emitted.attributes
    assert returned.attributes["lightning.reward.value"] in (0.0, 1.0)


def test_dev_runs_the_dev_flow_on_one_batch(tmp_path: Path) -> None:
    agent = LetterAgent()
    trainer = agl.Trainer(n_runners=1, **tiny_run(tmp_path, "agl-dev"))
    report = trainer.dev(agent, letter_tasks())
    assert report["rollouts"]["rollouts"] == report["rollouts"]["succeeded"] == 4 * 2
    assert report["batch"]["rows"] == 4 * 2 and report["batch"]["adapter"]["calls_without_token_ids"] == 0
    assert agent.trainer is trainer
