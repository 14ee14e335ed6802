"""`lightning debug compare-logprobs`: a stored LLM call whose log-probs are the model's own shows no mismatch; one
whose log-probs came from other weights shows it, token by token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning import semconv
from lightning.cli import main
from lightning.models import build_tiny_model
from lightning.store import SqlLightningStore
from lightning.types import Span, TraceStatus

PROMPT, RESPONSE = [382, 84, 82, 261, 198], [60, 97, 353]


def model_log_probs(model_dir: Path) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + RESPONSE])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(RESPONSE)[:, None])[:, 0].tolist()


async def store_call(url: str, logprobs: list[float], queue: str | None = None) -> str:
    """One rollout holding one stored LLM call, succeeded (in `queue`, if given)."""
    async with SqlLightningStore(url, watchdog_interval=None) as store:
        rollout = await store.start_rollout({"task": 1}, **({"queue": queue} if queue else {}))
        await store.add_span(
            Span(
                rollout_id=rollout.rollout_id, attempt_id=rollout.attempt.attempt_id, sequence_id=1, trace_id="t" * 32,
                span_id="s1", name="chat tiny", status=TraceStatus(status_code="OK"), start_time=1.0, end_time=2.0,
                attributes={
                    semconv.GEN_AI_OPERATION: "chat",
                    semconv.LLM_PROMPT_TOKEN_IDS: semconv.encode_token_ids(PROMPT),
                    semconv.LLM_RESPONSE_TOKEN_IDS: [semconv.encode_token_ids(RESPONSE)],
                    semconv.LLM_RESPONSE_LOGPROBS: [semconv.encode_logprobs(logprobs)],
                },
            )
        )  # fmt: skip
        await store.finish_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
        return rollout.rollout_id


@pytest.mark.parametrize("sampled_from", ["the same weights", "other weights"])
def test_compare_logprobs_finds_the_mismatch_only_where_there_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sampled_from: str
) -> None:
    model = build_tiny_model(tmp_path / "model", seed=0)
    sampler = model if sampled_from == "the same weights" else build_tiny_model(tmp_path / "other", seed=1)
    url = f"sqlite:///{tmp_path}/store.db"
    rollout_id = asyncio.run(store_call(url, model_log_probs(sampler)))

    assert main(["debug", "compare-logprobs", str(model), "--store", url, "--rollout", rollout_id]) == 0
    out = capsys.readouterr().out
    assert f"{len(RESPONSE)} sampled tokens in 1 LLM calls" in out, out
    largest = float(out.split("max ")[1].split(",")[0])
    if sampled_from == "the same weights":
        assert largest < 1e-5, out
    else:
        assert largest > 0.1 and rollout_id[:24] in out, out


def test_compare_logprobs_of_a_runs_queue_takes_its_newest_succeeded_rollouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's form, `lightning debug compare-logprobs CHECKPOINT --queue RUN`: the newest `--limit` succeeded
    rollouts of that queue only."""
    model = build_tiny_model(tmp_path / "model", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    url = f"sqlite:///{tmp_path}/store.db"
    older = asyncio.run(store_call(url, model_log_probs(other), queue="run-a"))
    newer = asyncio.run(store_call(url, model_log_probs(model), queue="run-a"))
    elsewhere = asyncio.run(store_call(url, model_log_probs(other), queue="run-b"))

    assert main(["debug", "compare-logprobs", str(model), "--store", url, "--queue", "run-a", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "in 1 LLM calls" in out and float(out.split("max ")[1].split(",")[0]) < 1e-5, out
    assert main(["debug", "compare-logprobs", str(model), "--store", url, "--queue", "run-a"]) == 0
    out = capsys.readouterr().out
    assert "in 2 LLM calls" in out and older[:24] in out and elsewhere[:24] not in out and newer, out
    with pytest.raises(SystemExit):  # a queue without succeeded rollouts: an error that says so
        main(["debug", "compare-logprobs", str(model), "--store", url, "--queue", "run-c"])
    assert "no succeeded rollouts in queue 'run-c'" in capsys.readouterr().err
