"""Asynchronous RL (`algorithm.max_staleness`): the start rule, the staleness filter on rollouts from a real SQLite
store, the wait that keeps updates in order, and (slow) the train flow overlapping iterations under Prefect."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning import pipeline, reporting, semconv
from lightning.adapter import adapt_rollouts
from lightning.store import SqlLightningStore
from lightning.types import Span, TraceStatus


def test_iteration_i_starts_once_iteration_i_minus_1_minus_k_is_done() -> None:
    # k = 0, today's loop: iteration 3 starts after iteration 2 (3 iterations completed), not before.
    assert pipeline.may_start(3, completed=3, max_staleness=0)
    assert not pipeline.may_start(3, completed=2, max_staleness=0)
    # k = 1: iteration 3 starts once iteration 1 is done (2 completed), while iteration 2 updates.
    assert pipeline.may_start(3, completed=2, max_staleness=1)
    assert not pipeline.may_start(3, completed=1, max_staleness=1)
    # k = 2: once iteration 0 is done; the first k + 1 iterations start at once.
    assert pipeline.may_start(3, completed=1, max_staleness=2)
    assert all(pipeline.may_start(i, completed=0, max_staleness=2) for i in range(3))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    try:
        yield store
    finally:
        await store.close()


async def sampled_at(store: SqlLightningStore, versions: list[int], logprobs: bool = True) -> str:
    """A finished rollout whose LLM calls were served by the policy versions given (one call each, as the proxy
    records them: token ids, the sampler's log-probs, `weight_version`), then rewarded 1."""
    rollout = await store.enqueue_rollout({"task": 1}, metadata={"group_id": "g"})
    claimed = await store.dequeue_rollout(worker_id="runner")
    assert claimed is not None and claimed.rollout_id == rollout.rollout_id
    ids = {"rollout_id": claimed.rollout_id, "attempt_id": claimed.attempt.attempt_id, "trace_id": "t" * 32}
    now, spans = time.time(), []
    for turn, version in enumerate(versions):
        attributes: dict[str, Any] = {
            semconv.GEN_AI_OPERATION: "chat", semconv.GEN_AI_REQUEST_MODEL: "policy",
            semconv.GEN_AI_INPUT_MESSAGES: json.dumps([{"role": "user", "content": "hi"}]),
            semconv.LLM_PROMPT_TOKEN_IDS: semconv.encode_token_ids([1, 2, 3 + turn]),
            semconv.LLM_RESPONSE_TOKEN_IDS: [semconv.encode_token_ids([4])], semconv.LLM_WEIGHT_VERSION: version,
        }  # fmt: skip
        if logprobs:
            attributes[semconv.LLM_RESPONSE_LOGPROBS] = [semconv.encode_logprobs([-0.5])]
        spans.append(Span(**ids, sequence_id=turn + 1, span_id=f"{turn:016x}", name="chat policy",
                          status=TraceStatus(status_code="OK"), attributes=attributes, start_time=now + turn,
                          end_time=now + turn + 0.5))  # fmt: skip
    spans.append(Span(**ids, sequence_id=len(versions) + 1, span_id="f" * 16, name=semconv.REWARD_SPAN,
                      attributes={semconv.REWARD_VALUE: 1.0}, start_time=now + 9, end_time=now + 9))  # fmt: skip
    await store.finish_attempt(claimed.rollout_id, claimed.attempt.attempt_id, "succeeded", spans)
    return claimed.rollout_id


async def test_rollouts_more_than_k_versions_old_are_dropped_and_every_decision_counted(
    store: SqlLightningStore,
) -> None:
    # The update starts from checkpoint 5; k = 1. Rollouts sampled at 5 (fresh), 4 (stale by one: used), 3 (two
    # behind: dropped), and a two-call one at 4 then 5 (its oldest call decides: stale by one).
    fresh, stale, old, mixed = [await sampled_at(store, versions) for versions in ([5], [4], [3], [4, 5])]
    triplets = (await adapt_rollouts(store, [fresh, stale, old, mixed])).triplets
    assert len(triplets) == 5  # transitions: one per LLM call

    kept, counts = pipeline.drop_stale(triplets, policy_version=5, max_staleness=1, corrected=False)
    assert [t.metadata["rollout_id"] for t in kept] == [fresh, stale, mixed, mixed]
    assert counts == {
        "stale_used": 2,
        "stale_corrected": 0,
        "stale_dropped": 1,
        "staleness_mean": 1.0,
        "staleness_max": 2,
    }  # fmt: skip  (0 + 1 + 2 + 1) / 4

    # With an off-policy correction, the stale ones that carry the sampler's log-probs are corrected, not used raw.
    _, counts = pipeline.drop_stale(triplets, policy_version=5, max_staleness=1, corrected=True)
    assert (counts["stale_used"], counts["stale_corrected"], counts["stale_dropped"]) == (0, 2, 1)
    no_logprobs = await sampled_at(store, [4], logprobs=False)
    more = (await adapt_rollouts(store, [no_logprobs])).triplets
    _, counts = pipeline.drop_stale(more, policy_version=5, max_staleness=1, corrected=True)
    assert (counts["stale_used"], counts["stale_corrected"]) == (1, 0)

    # k = 2 keeps the rollout two versions behind.
    kept, counts = pipeline.drop_stale(triplets, policy_version=5, max_staleness=2, corrected=False)
    assert len(kept) == 5 and counts["stale_dropped"] == 0 and counts["stale_used"] == 3


def test_an_iteration_whose_rollouts_were_all_too_stale_says_so_and_what_to_change() -> None:
    run = SimpleNamespace(config=SimpleNamespace(algorithm=SimpleNamespace(max_staleness=1), max_prompt_length=64))
    report = SimpleNamespace(
        rollouts_without_reward=0, rollouts_without_llm_calls=0, calls_without_token_ids=0, failed_calls=0
    )
    staleness = {"stale_used": 0, "stale_corrected": 0, "stale_dropped": 8, "staleness_mean": 2.5, "staleness_max": 3}
    reason = reporting.no_rows_reason(run, 7, 8, report, "no rows", staleness)  # type: ignore[arg-type]
    assert reason.startswith(
        "iteration 7: nothing to train on from 8 rollouts: 8 were sampled more than algorithm.max_staleness 1 policy "
        "versions before checkpoint 7 and dropped (up to 3 behind: raise max_staleness"
    ), reason


def test_a_sample_without_a_version_is_kept_and_not_counted() -> None:
    from lightning.types import Triplet

    unknown = Triplet(prompt=[1], response=[2], reward=1.0, metadata={"rollout_id": "r", "group_id": "g"})
    kept, counts = pipeline.drop_stale([unknown], policy_version=3, max_staleness=1, corrected=False)
    assert kept == [unknown] and counts["stale_used"] == counts["stale_dropped"] == 0
    assert counts["staleness_max"] == 0 and counts["staleness_mean"] == 0.0


async def test_an_update_waits_for_the_checkpoint_of_the_iteration_before() -> None:
    run: Any = SimpleNamespace(history=[{"iteration": 0}])
    assert await pipeline.wait_for_checkpoint(run, 0) < 0.05 and await pipeline.wait_for_checkpoint(run, 1) < 0.05
    waiting = asyncio.create_task(pipeline.wait_for_checkpoint(run, 2, poll=0.01))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # iteration 1 has not checkpointed
    run.history.append({"iteration": 1})
    assert await asyncio.wait_for(waiting, 1) >= 0.1


async def test_an_iteration_waits_for_its_turn_one_rollout_phase_at_a_time() -> None:
    collected: set[int] = set()
    history = [{"iteration": 0}]  # iteration 0's weights are served
    run: Any = SimpleNamespace(
        config=SimpleNamespace(algorithm=SimpleNamespace(max_staleness=1)),
        served_iterations=lambda: max((row["iteration"] + 1 for row in history), default=0),
        iteration_reached=lambda iteration, phase: phase == "collected" and iteration in collected,
    )
    assert await pipeline.wait_for_turn(run, 1) < 0.05  # the iteration before is done
    # Iteration 2 may sample one version behind (iteration 0 is done), but not beside iteration 1's rollouts.
    waiting = asyncio.create_task(pipeline.wait_for_turn(run, 2, poll=0.01))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    collected.add(1)
    assert await asyncio.wait_for(waiting, 1) >= 0.1
    # Iteration 3: iteration 2's rollouts are in, but sampling now would be two versions behind.
    collected.add(2)
    waiting = asyncio.create_task(pipeline.wait_for_turn(run, 3, poll=0.01))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    history.append({"iteration": 1})
    assert await asyncio.wait_for(waiting, 1) >= 0.1


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_the_pipeline_keeps_its_window_and_evaluates_with_nothing_in_flight(max_staleness: int) -> None:
    """`Pipeline`: at most max_staleness + 2 iterations in flight (one with 0), each finished in order, and an
    evaluation in the middle (eval_every 2) runs after the iterations before it, before any after it starts."""
    begun: set[int] = set()
    running: set[int] = set()
    events: list[tuple[str, int]] = []
    most = 0
    run: Any = SimpleNamespace(
        config=SimpleNamespace(algorithm=SimpleNamespace(max_staleness=max_staleness), eval_every=2, iterations=5),
        iteration_reached=lambda iteration, phase: phase == "begun" and iteration in begun,
    )

    async def run_iteration(iteration: int) -> dict[str, Any]:
        nonlocal most
        begun.add(iteration)
        running.add(iteration)
        most = max(most, len(running))
        await asyncio.sleep(0.02 * (3 - iteration % 3))  # later iterations may end first: they finish in order
        running.discard(iteration)
        return {"iteration": iteration}

    async def evaluate(step: int) -> None:
        assert not running, f"evaluation {step} beside iterations {running}"
        events.append(("evaluate", step))

    async def report(iteration: int, result: dict[str, Any]) -> None:
        assert result == {"iteration": iteration}
        events.append(("report", iteration))

    async with pipeline.Pipeline(run, run_iteration, evaluate, report) as in_flight:
        for iteration in range(5):
            await in_flight.start(iteration)
        await in_flight.finish()
    # The evaluation of checkpoint 2 comes once iteration 1 is done, before it is reported.
    assert events == [
        ("report", 0), ("evaluate", 2), ("report", 1), ("report", 2), ("evaluate", 4), ("report", 3), ("report", 4)
    ], events  # fmt: skip
    assert most <= (1 if max_staleness == 0 else max_staleness + 2), most


# --- the flow ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
async def test_three_iterations_with_max_staleness_1_overlap_and_count_staleness(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.train import train
    from lightning.config import load_config
    from lightning.run import recorded_history

    config = load_config({
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
        "run_name": "a", "iterations": 3, "batch_size": 4, "samples_per_task": 4, "n_runners": 1,
        "runner_concurrency": 16, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 1, "ppo_epochs": 100, "max_staleness": 1,
                      "off_policy_correction": "tis"},
        "checkpoint": {"keep_last": 5}, "mlflow_traces": {"train_per_iteration": 2, "evaluation": 0},
        "store_url": f"sqlite:///{tmp_path}/store.db", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    })  # fmt: skip
    # The update takes seconds (100 epochs, a row at a time): longer than Prefect's temporary server takes to start the
    # next iteration's subflow beside it (with 40, a full `make test` once saw it begin 0.65 s after the update), so
    # the overlap shows on a loaded machine too.
    summary = await train(config)
    assert summary["iterations"] == 3

    history = recorded_history(config)
    assert [row["iteration"] for row in history] == [0, 1, 2]
    for row in history:
        assert set(pipeline.STALENESS_METRICS) <= row.keys(), row
        assert row["stale_dropped"] == 0 and row["staleness_max"] <= 1
    # Iteration 0 samples from checkpoint 0 and updates it: fresh. Iteration 1 starts beside it, and updates checkpoint
    # 1: its rollouts served before checkpoint 1 was published (how many depends on timing) are one version behind,
    # each corrected by TIS (the proxy stores the sampler's log-probs), none used raw.
    assert history[0]["staleness_max"] == 0, history
    for iteration in (1, 2):
        rows = json.loads((config.run_dir / "batches" / f"iteration-{iteration:06d}" / "batch.json").read_text())
        behind = {row["rollout_id"] for row in rows["metadata"] if row["weight_version"] < iteration}
        assert history[iteration]["stale_corrected"] == len(behind) and history[iteration]["stale_used"] == 0
    assert "is_ratio_mean" in history[1]

    # The overlap: iteration 1's rollouts started while iteration 0 updated and checkpointed (before its checkpoint
    # task ended, in Prefect's timeline; the update alone left too narrow a window on a loaded machine).
    async with get_client() as client:
        [flow_run] = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["a-iteration-0"]))
        )
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
    [checkpoint] = [task_run for task_run in task_runs if task_run.name.startswith("checkpoint")]
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        rollouts = await store.query_rollouts(mode="train", queue="a")
    first_of_1 = min(r.attempt.start_time for r in rollouts if r.metadata["iteration"] == 1)
    assert first_of_1 < checkpoint.end_time.timestamp()
