"""The two agent-lightning examples ported in its style (examples/agl_sql_agent, examples/agl_room_selector): each
solves its tasks through a runner when a capable model answers (a scripted OpenAI-compatible endpoint), and its
`train.py` trains it through `agl.Trainer(...).fit(...)` on the tiny model (the plumbing: no reward is expected)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.scripted_agl import scripted_room_app, scripted_sql_app
from support.servers import serving

import lightning as agl
from examples.agl_room_selector import agent as rooms
from examples.agl_room_selector import train as train_rooms
from examples.agl_sql_agent import agent as sql
from examples.agl_sql_agent import train as train_sql
from lightning.checkpoint import latest_checkpoint


async def run_all(agent: Any, tasks: list[dict[str, Any]], app: Any, tmp_path: Path) -> list[list[Any]]:
    """Every task through one runner, the agent's `main_llm` being `app`; each rollout's reward spans."""
    store = agl.SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    try:
        with serving(app) as url:
            await store.add_resources({"main_llm": agl.LLM(endpoint=f"{url}/v1", model="scripted")})
            queued = await store.enqueue_many_rollouts([{"input": task} for task in tasks])
            runner = agl.Runner(agent, store, idle_wait=0.1)
            assert await runner.iter(max_rollouts=len(tasks)) == len(tasks)
            await runner.close()
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in queued], timeout=5)
        assert [r.status for r in finished] == ["succeeded"] * len(tasks)
        by_id = {r.rollout_id: r for r in finished}
        return [
            [s for s in await store.query_spans(r.rollout_id) if s.name == "lightning.reward"]
            for r in queued
            if r.rollout_id in by_id
        ]
    finally:
        await store.close()


async def test_the_sql_agent_solves_every_question_and_rewrites_a_failing_query(tmp_path: Path) -> None:
    tasks = sql.tasks()
    broken = frozenset({tasks[1]["question"]})
    app = scripted_sql_app({task["question"]: task["gold_sql"] for task in tasks}, broken_first=broken)
    rewards = await run_all(sql.LitSqlAgent(), tasks, app, tmp_path)
    # Each rollout: the dict of rewards emitted with keywords, then the bool it returned.
    assert [agl.find_final_reward(spans) for spans in rewards] == [1.0] * len(tasks)
    assert [spans[0].attributes["turns"] for spans in rewards] == [1, 2] + [1] * (len(tasks) - 2)
    assert all(spans[0].attributes["lightning.reward.primary_key"] == "correct" for spans in rewards)
    assert len(app.state.requests) == len(tasks) + 1


async def test_the_room_selector_calls_its_tool_and_picks_the_expected_room(tmp_path: Path) -> None:
    tasks = rooms.tasks()
    app = scripted_room_app()
    rewards = await run_all(rooms.room_selector, tasks, app, tmp_path)
    assert [agl.find_final_reward(spans) for spans in rewards] == [1.0] * len(tasks)
    assert [spans[-1].attributes["choice"] for spans in rewards] == [task["expected_choice"] for task in tasks]
    assert all(spans[-1].attributes["lightning.reward.used_tool"] == 1.0 for spans in rewards)
    assert len(app.state.requests) == 2 * len(tasks)  # the tool call, then the choice


def test_the_grader_and_the_tool_agree() -> None:
    task = {"date": "2025-10-13", "time": "10:00", "duration_min": 60, "attendees": 5, "needs": ["projector"]}
    assert rooms.best_room({**task, "accessible_required": False}) == "Vega"  # Orion is booked 10:00-12:00
    assert rooms.final_choice("I pick Vega.\nfinal_choice: vega") == "Vega" and rooms.final_choice("Vega") is None
    assert rooms.run_tool('{"date": "x"}').startswith("error:")
    assert sql.extract_query("Here:\n```sql\nSELECT 1\n```") == "SELECT 1"


# --- their train.py on the tiny model, through agl.Trainer(...).fit(...) ---


@pytest.fixture(scope="module")
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def tiny_overrides(tmp_path: Path) -> dict[str, Any]:
    return {
        "iterations": 1,
        "batch_size": 2,
        "samples_per_task": 2,
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 8},
        "max_prompt_length": 480,
        "max_response_length": 8,
        "checkpoint": {"keep_last": 1, "log_every": 1},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("example", [train_sql, train_rooms], ids=["sql_agent", "room_selector"])
def test_its_train_script_trains_it_on_the_tiny_model(prefect_server: None, example: Any, tmp_path: Path) -> None:
    summary = example.train(**tiny_overrides(tmp_path))
    assert summary["iterations"] == 1 and summary["run_name"] == example.DEFAULTS["run_name"]
    assert summary["reward_before"] == 0.0  # the tiny model writes no query and calls no tool
    final = latest_checkpoint(tmp_path / "runs" / example.DEFAULTS["run_name"] / "checkpoints")
    assert final is not None and summary["checkpoint"] == str(final)
