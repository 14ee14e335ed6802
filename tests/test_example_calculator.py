"""The calculator example agent, run by a runner against an OpenAI-shaped endpoint on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.scripted_openai import scripted_calculator_app
from support.servers import serving

from examples.calculator.agent import calculate, calculator_agent, load_tasks, reward
from lightning.runner import Runner
from lightning.store import SqlLightningStore
from lightning.tracing import find_final_reward
from lightning.types import LLM


async def test_calculator_agent_solves_every_task_through_a_runner(tmp_path: Path) -> None:
    tasks = load_tasks()
    app = scripted_calculator_app()
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    with serving(app) as url:
        await store.add_resources({"main_llm": LLM(endpoint=f"{url}/v1", model="scripted", sampling_parameters={})})
        queued = await store.enqueue_many_rollouts([{"input": task} for task in tasks])
        runner = Runner(calculator_agent, store, idle_wait=0.1)
        assert await runner.iter(max_rollouts=len(tasks)) == len(tasks)
        await runner.close()
    finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in queued], timeout=5)
    assert [r.status for r in finished] == ["succeeded"] * len(tasks)
    for rollout in finished:
        assert find_final_reward(await store.query_spans(rollout.rollout_id)) == 1.0
    # Two model calls per task: one that asks for the tool, one that reads its result.
    assert len(app.state.requests) == 2 * len(tasks)
    tool_replies = [m for body in app.state.requests for m in body["messages"] if m["role"] == "tool"]
    assert sorted(float(m["content"]) for m in tool_replies) == sorted(float(t["answer"]) for t in tasks)
    await store.close()


def test_calculator_evaluates_arithmetic_and_refuses_anything_else() -> None:
    assert calculate("(17 + 4) * 3") == 63
    assert calculate("-2 ** 3 // 3") == -3
    for hostile in ("__import__('os').system('true')", "open('/etc/passwd')", "2 ** 10000", "x + 1"):
        with pytest.raises(ValueError):
            calculate(hostile)


def test_reward_reads_the_last_number_of_the_answer() -> None:
    assert reward("First 3, so the answer is 1,024.", "1024") == 1.0
    assert reward("I don't know", "4") == 0.0
    assert reward("4.0", "4") == 1.0
