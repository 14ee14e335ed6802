"""Agents that misbehave as users' agents do, on a real run (a SQLite store, the runners, the LLM proxy and the
embedded inference server on the tiny model, the adapter, the trainer process): each gets its rollouts marked
failed with the reason, or dropped and counted, and none reaches the trainer as a number it should not."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning import stages
from lightning.config import TrainConfig, load_config
from lightning.run import Run

pytestmark = pytest.mark.slow

AGENT = "support.misbehaving:misbehaving_agent"
LETTERS = ["bdfg", "jkmp", "gfdb", "pmkj", "bbdd", "ffgg", "jjkk", "mmpp", "bdbd", "kmkm"]


def config_for(tmp_path: Path, tasks: list[dict[str, Any]], **changes: Any) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    settings = {
        "run_name": "misbehaving", "agent": AGENT, "train_data": str(data), "batch_size": len(tasks),
        "samples_per_task": 2, "n_runners": 1, "runner_concurrency": 8, "rollout_retries": 0,
        "rollout": {"max_attempts": 1, "timeout_seconds": 60}, "dynamic_sampling": False,
        "sampling": {"temperature": 1.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64}, "inference": {"in_process": True},
        "proxy_in_process": True, "mlflow_traces": {"train_per_iteration": 0, "evaluation": 0},
        "store_url": f"sqlite:///{tmp_path}/store.db", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    for name, value in changes.items():
        settings[name] = {**settings[name], **value} if isinstance(value, dict) and name in settings else value
    return load_config(settings)


@contextlib.asynccontextmanager
async def opened(config: TrainConfig, train: bool = False) -> AsyncIterator[Run]:
    run = await Run.open(config, train=train, track=False)
    try:
        yield run
    finally:
        await run.close()


def tasks_of(kind: str | None, count: int = 4, **extra: Any) -> list[dict[str, Any]]:
    return [{"letters": letters, "target": letters[-1], "misbehave": kind, **extra} for letters in LETTERS[:count]]


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("nan", "ValueError: emit_reward: the reward must be a finite float, got nan"),
        ("inf", "ValueError: emit_reward: the reward must be a finite float, got inf"),
        ("string", "TypeError: the agent returned str"),
        ("huge", "ValueError: emit_reward: the reward 1e+308 is past +-1e+06"),
    ],
)
async def test_a_bad_reward_fails_its_rollout_and_the_error_says_which(tmp_path: Path, kind: str, reason: str) -> None:
    async with opened(config_for(tmp_path, tasks_of(kind))) as run:
        with pytest.raises(stages.RolloutsFailed) as failed:
            await stages.collect_rollouts(run, 0)
        statuses = {rollout.status for rollout in await run.store.query_rollouts(queue=run.queue)}
    first_line = str(failed.value).splitlines()[0]
    assert first_line.startswith("iteration 0: 0 of 8 rollouts succeeded") and reason in first_line, first_line
    # The agent's own line, not the runner's that found the value wrong (the traceback holds only the runner's).
    assert "misbehaving_agent at tests/support/misbehaving.py:" in first_line, first_line
    assert "lightning/" not in first_line, first_line
    assert statuses == {"failed"}


async def test_a_bad_held_out_reward_names_the_checkpoint_evaluated_not_an_iteration(tmp_path: Path) -> None:
    """Held-out rollouts are numbered by the checkpoint they evaluate (-1: the model before a warm start); the
    error said "iteration -1"."""
    async with opened(config_for(tmp_path, tasks_of("nan"), val_data=str(tmp_path / "train.jsonl"))) as run:
        with pytest.raises(stages.RolloutsFailed) as failed:
            await stages.collect_rollouts(run, -1, "val")
    first_line = str(failed.value).splitlines()[0]
    assert first_line.startswith("the held-out evaluation of the initial model: 0 of 4 rollouts"), first_line


async def test_a_rollout_without_a_reward_is_never_trained_on_as_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that returns None and emits no reward: its calls are dropped and counted, never given reward 0."""
    monkeypatch.delenv("LIGHTNING_PROXY_TOKEN", raising=False)
    async with opened(config_for(tmp_path, tasks_of("none"))) as run:
        # The runners read the proxy's token from the process's environment (the store never holds it)...
        assert os.environ["LIGHTNING_PROXY_TOKEN"] == run.proxy_token
        ids, summary = await stages.collect_rollouts(run, 0)
        with pytest.raises(stages.NoTrainingRows) as empty:
            await stages.adapt_spans(run, 0, ids)
    assert "LIGHTNING_PROXY_TOKEN" not in os.environ  # ... and it goes with the run: the process is as it was
    assert summary["succeeded"] == 8 and summary["with_reward"] == 0
    assert str(empty.value).startswith(
        "iteration 0: nothing to train on from 8 rollouts: 8 had no reward (the agent returned None and emitted none"
    ), str(empty.value)


async def test_an_agent_that_never_returns_is_ended_by_the_rollout_timeout(tmp_path: Path) -> None:
    config = config_for(tmp_path, tasks_of("hang", count=2), rollout={"timeout_seconds": 3, "max_attempts": 1})
    async with opened(config) as run:
        started = time.monotonic()
        with pytest.raises(stages.RolloutsFailed) as failed:
            await stages.collect_rollouts(run, 0)
        took = time.monotonic() - started
    assert "latest attempts {'timeout': 4}" in str(failed.value).splitlines()[0], str(failed.value)
    assert took < 30, f"the hung rollouts took {took:.1f} s to end (rollout.timeout_seconds 3)"


async def test_an_agent_that_blocks_the_event_loop_fails_its_rollouts_naming_the_line_and_the_others_finish(
    tmp_path: Path,
) -> None:
    """`time.sleep` inside `async def` in half the rollouts: each holds the loop the runners share for 5 s; the
    watchdog fails it at `timeouts.blocked_loop` (3 s), naming the line, and the other rollouts succeed. (At 1 s, a
    well-behaved rollout was blamed once when CI's loaded cores starved the whole process for a second.)"""
    from openai import AsyncOpenAI

    # The well-behaved rollouts' OpenAI client loads its resources on first use, which blocks the loop too (1.2 s on
    # 2 loaded cores; far below the default blocked_loop, near this test's 3 s): loaded here first.
    assert AsyncOpenAI(base_url="http://127.0.0.1:9", api_key="unused").chat.completions is not None
    support = Path(__file__).parent / "support" / "misbehaving.py"
    line = next(n for n, text in enumerate(support.read_text().splitlines(), 1) if "# BLOCKS" in text)
    tasks = tasks_of("block", count=2, block_seconds=5.0) + tasks_of(None, count=4)[2:]
    config = config_for(tmp_path, tasks, timeouts={"blocked_loop": 3.0})
    async with opened(config) as run:
        started = time.monotonic()
        with pytest.raises(stages.RolloutsFailed) as failed:
            await stages.collect_rollouts(run, 0)
        took = time.monotonic() - started
        statuses = Counter(rollout.status for rollout in await run.store.query_rollouts(queue=run.queue))
    first_line = str(failed.value).splitlines()[0]
    assert first_line.startswith("iteration 0: 4 of 8 rollouts succeeded"), first_line
    assert "the agent raised EventLoopBlocked: the agent blocked its runner's event loop for 3." in first_line
    assert f"support/misbehaving.py:{line} in misbehaving_agent" in first_line, first_line
    assert statuses == {"succeeded": 4, "failed": 4}
    assert took < 60, f"the rollout phase took {took:.1f} s with four 5 s blocks"


async def test_an_agent_that_raises_in_30_percent_of_rollouts_is_counted_and_the_iteration_goes_on(
    tmp_path: Path,
) -> None:
    tasks = tasks_of("raise30", count=10)
    raising = sum(zlib.crc32(task["letters"].encode()) % 10 < 3 for task in tasks)
    assert 2 <= raising <= 4  # about 30% of the tasks, each of its two samples
    async with opened(config_for(tmp_path, tasks, min_success_fraction=0.5)) as run:
        ids, summary = await stages.collect_rollouts(run, 0)
        batch = await stages.adapt_spans(run, 0, ids)
    assert (summary["succeeded"], summary["failed"]) == (20 - 2 * raising, 2 * raising)
    assert batch["rows"] == 20 - 2 * raising


async def test_an_agent_that_emits_10000_spans_is_stored_and_trained_on_once(tmp_path: Path) -> None:
    config = config_for(tmp_path, tasks_of("spans", count=1, spans=10_000), samples_per_task=1)
    async with opened(config) as run:
        started = time.monotonic()
        ids, summary = await stages.collect_rollouts(run, 0)
        took = time.monotonic() - started
        batch = await stages.adapt_spans(run, 0, ids)
        adapted = time.monotonic() - started - took
        spans = await run.store.query_latest_spans(ids)
    assert summary["succeeded"] == 1 and batch["rows"] == 1  # its one LLM call, whatever else it emitted
    assert [len(found) > 10_000 for found in spans.values()] == [True]
    print(f"\na rollout of 10,000 spans: {took:.1f} s, its adapter {adapted:.1f} s")


async def test_a_prompt_longer_than_max_prompt_length_is_dropped_and_counted(tmp_path: Path) -> None:
    long = [{"letters": "bdfgjkmp" * 8, "target": "p", "misbehave": None}]
    async with opened(config_for(tmp_path, long + tasks_of(None, count=1), max_prompt_length=32)) as run:
        ids, summary = await stages.collect_rollouts(run, 0)
        batch = await stages.adapt_spans(run, 0, ids)
    assert summary["succeeded"] == 4
    assert batch["rows"] == 2 and batch["batch"]["prompt_too_long"] == 2, batch


async def test_no_bad_reward_reaches_the_trainer(tmp_path: Path) -> None:
    """A batch where most agents misbehave, trained on: only the good rollouts' rows, finite and in range."""
    tasks = [
        {"letters": letters, "target": letters[-1], "misbehave": kind}
        for letters, kind in zip(LETTERS, ["nan", "inf", "none", "string", "huge", None, "raise30", None], strict=False)
    ]
    config = config_for(tmp_path, tasks, min_success_fraction=0.1)
    async with opened(config, train=True) as run:
        ids, summary = await stages.collect_rollouts(run, 0)
        batch = await stages.adapt_spans(run, 0, ids)
        metrics = await stages.ppo_step(run, 0, batch["batch_path"])
    good = 2 * sum(
        kind is None or (kind == "raise30" and zlib.crc32(letters.encode()) % 10 >= 3)
        for letters, kind in ((task["letters"], task["misbehave"]) for task in tasks)
    )
    assert batch["rows"] == good, (batch, summary)
    scores = load_file(Path(batch["batch_path"]) / "tensors.safetensors")["token_level_scores"]
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
    assert all(math.isfinite(value) for value in metrics.values() if isinstance(value, float)), metrics
