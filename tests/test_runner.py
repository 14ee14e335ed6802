"""Runner and agent API: outcomes, retries, heartbeats, abandonment, hooks, and fleets of runners."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lightning.agent import Hook, LitAgent, rollout
from lightning.runner import Runner, run_fleet
from lightning.runner.fleet import start_runner_threads
from lightning.store import SqlLightningStore
from lightning.tracing import emit_reward, find_final_reward
from lightning.types import LLM, AttemptedRollout, PromptTemplate, ProxyLLM, RolloutConfig, Span


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=0.05)
    yield store
    await store.close()


async def final_reward(store: Any, rollout_id: str) -> float | None:
    return find_final_reward(await store.query_spans(rollout_id))


@rollout
def fixed_reward_agent(task: dict[str, Any]) -> float:
    return float(task["reward"])


async def test_step_runs_the_agent_and_its_float_becomes_the_reward(store: Any) -> None:
    runner = Runner(fixed_reward_agent, store)
    finished = await runner.step({"reward": 0.75})
    assert finished.status == "succeeded"
    assert await final_reward(store, finished.rollout_id) == 0.75
    await runner.close()


async def test_a_numpy_number_is_a_reward_like_a_float(store: Any) -> None:
    import numpy as np

    @rollout
    def numpy_agent(task: dict[str, Any]) -> Any:
        return np.float32(task["reward"])

    runner = Runner(numpy_agent, store)
    finished = await runner.step({"reward": 0.5})
    assert finished.status == "succeeded" and await final_reward(store, finished.rollout_id) == 0.5
    await runner.close()


async def test_agent_that_emits_its_reward_returns_none(store: Any) -> None:
    @rollout
    async def agent(task: dict[str, Any]) -> None:
        emit_reward(0.25)

    runner = Runner(agent, store)
    finished = await runner.step({})
    assert finished.status == "succeeded"
    assert await final_reward(store, finished.rollout_id) == 0.25
    await runner.close()


async def test_agent_exception_fails_the_attempt_with_an_exception_span(store: Any) -> None:
    @rollout
    def agent(task: dict[str, Any]) -> float:
        raise RuntimeError("tool exploded")

    runner = Runner(agent, store)
    finished = await runner.step({})
    assert finished.status == "failed"
    spans = await store.query_spans(finished.rollout_id)
    assert any("tool exploded" in span.model_dump_json() for span in spans)
    await runner.close()


async def test_failed_attempt_is_retried_per_rollout_config(store: Any) -> None:
    calls: Counter[str] = Counter()

    @rollout
    def flaky(task: dict[str, Any], rollout: AttemptedRollout) -> float:
        calls[rollout.rollout_id] += 1
        if rollout.attempt.sequence_id == 1:
            raise RuntimeError("first try fails")
        return 1.0

    queued = await store.enqueue_rollout({}, config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    runner = Runner(flaky, store, idle_wait=0.1)
    assert await runner.iter(max_rollouts=2) == 2
    done = await store.get_rollout_by_id(queued.rollout_id)
    assert done is not None and done.status == "succeeded"
    assert calls[queued.rollout_id] == 2
    await runner.close()


async def test_heartbeats_keep_a_long_quiet_agent_alive(store: Any) -> None:
    @rollout
    async def slow(task: dict[str, Any]) -> float:
        await asyncio.sleep(1.0)  # no spans for longer than unresponsive_seconds
        return 1.0

    runner = Runner(slow, store, heartbeat_interval=0.1)
    finished = await runner.step({}, config=RolloutConfig(unresponsive_seconds=0.4))
    assert finished.status == "succeeded"
    await runner.close()


async def test_runner_abandons_an_attempt_the_store_timed_out_and_writes_nothing_over_it(store: Any) -> None:
    @rollout
    async def slow(task: dict[str, Any]) -> float:
        await asyncio.sleep(5.0)
        return 1.0

    runner = Runner(slow, store, heartbeat_interval=0.1)
    started_at = time.monotonic()
    finished = await runner.step({}, config=RolloutConfig(timeout_seconds=0.3))
    assert time.monotonic() - started_at < 3.0
    assert finished.status == "failed"
    attempt = await store.get_latest_attempt(finished.rollout_id)
    assert attempt is not None and attempt.status == "timeout"
    await runner.close()


async def test_idle_runner_reacts_at_once_to_new_work(store: Any) -> None:
    runner = Runner(fixed_reward_agent, store, idle_wait=5.0)
    task = asyncio.create_task(runner.iter(max_rollouts=1))
    await asyncio.sleep(0.3)
    enqueued_at = time.monotonic()
    queued = await store.enqueue_rollout({"reward": 1.0})
    await asyncio.wait_for(task, timeout=5)
    assert time.monotonic() - enqueued_at < 1.0
    done = await store.get_rollout_by_id(queued.rollout_id)
    assert done is not None and done.status == "succeeded"
    await runner.close()


async def test_hooks_run_in_order(store: Any) -> None:
    seen: list[str] = []

    class Recorder(Hook):
        async def on_rollout_start(self, **kwargs: Any) -> None:
            seen.append("rollout_start")

        async def on_trace_start(self, **kwargs: Any) -> None:
            seen.append("trace_start")

        async def on_trace_end(self, **kwargs: Any) -> None:
            seen.append("trace_end")

        async def on_rollout_end(self, *, status: str, **kwargs: Any) -> None:
            seen.append(f"rollout_end:{status}")

    runner = Runner(fixed_reward_agent, store, hooks=[Recorder()])
    await runner.step({"reward": 1.0})
    assert seen == ["rollout_start", "trace_start", "trace_end", "rollout_end:succeeded"]
    await runner.close()


async def test_litagent_subclass_with_separate_validation_rollout(store: Any) -> None:
    class Agent(LitAgent[dict]):
        def training_rollout(self, task: dict, resources: Any, rollout: AttemptedRollout) -> float:
            return 0.1

        def validation_rollout(self, task: dict, resources: Any, rollout: AttemptedRollout) -> float:
            return 0.9

    runner = Runner(Agent(), store)
    trained = await runner.step({}, mode="train")
    validated = await runner.step({}, mode="val")
    assert await final_reward(store, trained.rollout_id) == 0.1
    assert await final_reward(store, validated.rollout_id) == 0.9
    await runner.close()


async def test_resources_reach_the_agent_and_a_proxy_llm_is_routed_to_the_attempt(store: Any) -> None:
    seen: dict[str, Any] = {}

    @rollout
    def agent(task: dict[str, Any], llm: LLM, prompt_template: PromptTemplate, rollout: AttemptedRollout) -> float:
        seen.update(url=llm.base_url, prompt=prompt_template.format(x=task["x"]), rollout=rollout)
        return 1.0

    await store.add_resources(
        {
            "policy": ProxyLLM(endpoint="http://127.0.0.1:9/v1", model="tiny"),
            "prompt": PromptTemplate(template="solve {x}", engine="f-string"),
        }
    )
    runner = Runner(agent, store)
    finished = await runner.step({"x": "2+2"})
    assert finished.status == "succeeded"
    claimed = seen["rollout"]
    assert seen["url"] == f"http://127.0.0.1:9/rollout/{claimed.rollout_id}/attempt/{claimed.attempt.attempt_id}/v1"
    assert seen["prompt"] == "solve 2+2"
    await runner.close()


async def test_agent_asking_for_a_missing_resource_fails_with_a_clear_span(store: Any) -> None:
    @rollout
    def agent(task: dict[str, Any], llm: LLM) -> float:
        return 1.0

    runner = Runner(agent, store)
    finished = await runner.step({})
    assert finished.status == "failed"
    spans = await store.query_spans(finished.rollout_id)
    assert any("have no LLM" in span.model_dump_json() for span in spans)
    await runner.close()


async def test_agent_returning_spans_has_them_stored(store: Any) -> None:
    @rollout
    def agent(task: dict[str, Any], rollout: AttemptedRollout) -> list[Span]:
        return [
            Span(rollout_id="", attempt_id="", sequence_id=0, trace_id="a" * 32, span_id=f"{i:016x}", name=f"step{i}")
            for i in range(3)
        ]

    runner = Runner(agent, store)
    finished = await runner.step({})
    names = [span.name for span in await store.query_spans(finished.rollout_id)]
    assert {"step0", "step1", "step2"} <= set(names)
    await runner.close()


def test_rollout_decorator_rejects_parameters_it_cannot_fill() -> None:
    with pytest.raises(TypeError, match="'database'"):

        @rollout
        def agent(task: Any, database: Any) -> float:
            return 0.0


def test_rollout_decorated_function_is_still_callable() -> None:
    assert fixed_reward_agent({"reward": 2}) == 2.0


async def test_eight_runner_threads_drain_500_rollouts_each_exactly_once(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/fleet.db", watchdog_interval=None)
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    @rollout
    def agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
        with lock:
            runs[rollout.rollout_id] += 1
        return 1.0

    queued = await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(500)])
    ids = [r.rollout_id for r in queued]
    stop = threading.Event()
    threads = start_runner_threads(lambda i: Runner(agent, store, worker_id=f"t{i}", idle_wait=0.2), 8, stop)
    finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=120)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert len(finished) == 500 and all(r.status == "succeeded" for r in finished)
    assert set(runs) == set(ids) and set(runs.values()) == {1}
    workers = {w.worker_id for w in await store.query_workers()}
    assert len(workers) > 1  # the work really was shared
    await store.close()


async def test_a_fleet_on_one_loop_runs_each_rollout_once_on_its_runners_and_reads_resources_once(
    tmp_path: Path,
) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/fleet.db", watchdog_interval=None)
    runs: Counter[str] = Counter()
    running = 0
    most_at_once = 0

    @rollout
    async def agent(task: dict[str, Any], rollout: AttemptedRollout, prompt_template: PromptTemplate) -> float:
        nonlocal running, most_at_once
        runs[rollout.rollout_id] += 1
        running += 1
        most_at_once = max(most_at_once, running)
        await asyncio.sleep(0.01)
        running -= 1
        return 1.0

    resources = await store.add_resources({"prompt": PromptTemplate(template="{x}", engine="f-string")})
    brought = 0  # resources that claims brought
    claim_rollouts = store.claim_rollouts

    async def counted_claim(*args: Any, **kwargs: Any) -> Any:
        nonlocal brought
        claim = await claim_rollouts(*args, **kwargs)
        brought += len(claim.resources)
        return claim

    store.claim_rollouts = counted_claim  # type: ignore[method-assign]
    queued = await store.enqueue_many_rollouts(
        [{"input": {"i": i}, "resources_id": resources.resources_id, "queue": "q"} for i in range(40)]
    )
    ids = [r.rollout_id for r in queued]
    fleet = [Runner(agent, store, worker_id=f"r{i}", queue="q") for i in range(8)]
    stop = asyncio.Event()
    working = asyncio.create_task(run_fleet(fleet, store, stop_event=stop, queue="q"))
    finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=60)
    stop.set()
    assert await working == 40
    assert len(finished) == 40 and all(r.status == "succeeded" for r in finished)
    assert set(runs) == set(ids) and set(runs.values()) == {1}
    assert 1 < most_at_once <= 8  # the runners shared the work, one rollout each at a time
    assert brought == 1  # the fleet's resources came once, with the first claim, not per rollout
    attempts = [r.attempt for r in finished if isinstance(r, AttemptedRollout)]
    assert {a.worker_id for a in attempts} <= {f"r{i}" for i in range(8)}  # each attempt names its runner
    await store.close()
