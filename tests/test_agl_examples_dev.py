"""agent-lightning-style example agents (examples/agl_langgraph_sql, agl_room_selector, agl_apo_room_selector),
each run through `Trainer(...).dev(...)` as agent-lightning's docs run them: code that differs from agl's only in its
import lines. The LLM is a scripted OpenAI-compatible endpoint given as `initial_resources` (a capable model's
answers, not a model), reached through the run's LLM proxy on loopback, which in Trainer's runs serves the agents'
placeholder API key. Each test runs in its own directory: the run's store, MLflow and files go to their defaults
there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.scripted_agl import scripted_room_app, scripted_sql_app
from support.servers import serving

from examples.agl_apo_room_selector.agent import prompt_template_baseline, room_selector, transcripts
from examples.agl_room_selector import agent as rooms
from examples.agl_sql_agent.agent import tasks as sql_tasks
from lightning import Trainer
from lightning.store import SqlLightningStore
from lightning.types import LLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def dev_rollouts(trainer: Trainer) -> list[Any]:
    assert trainer.config is not None
    async with SqlLightningStore(trainer.config.store_url, watchdog_interval=None) as store:
        return [
            (rollout, await transcripts(store, rollout.rollout_id))
            for rollout in await store.query_rollouts(queue=f"{trainer.config.run_name}.dev")
        ]


def test_the_langgraph_sql_agent_runs_through_trainer_dev() -> None:
    # Here, not at the top: LangGraph costs every pytest process (each xdist worker) seconds to import.
    from examples.agl_langgraph_sql.agent import LangGraphSqlAgent

    tasks = sql_tasks()
    broken = frozenset({tasks[0]["question"]})
    app = scripted_sql_app({task["question"]: task["gold_sql"] for task in tasks}, broken_first=broken)
    with serving(app) as url:
        # agent-lightning's way, imports aside
        trainer = Trainer(n_workers=1, initial_resources={"main_llm": LLM(endpoint=f"{url}/v1", model="scripted")})
        report = trainer.dev(LangGraphSqlAgent(), tasks)

    assert report["rollouts"]["succeeded"] == report["rollouts"]["rollouts"] == len(tasks)  # each task once
    assert report["rollouts"]["reward_mean"] == 1.0
    assert report["batch"]["rows"] == len(tasks) + 1  # one training row per LLM call: the rewrite's too
    assert all(request["model"] == "scripted" for request in app.state.requests)


def test_the_tool_calling_room_selector_runs_through_trainer_dev() -> None:
    tasks = rooms.tasks()
    with serving(scripted_room_app()) as url:
        trainer = Trainer(n_workers=1, initial_resources={"main_llm": LLM(endpoint=f"{url}/v1", model="scripted")})
        report = trainer.dev(rooms.room_selector, tasks)

    assert report["rollouts"]["succeeded"] == len(tasks) and report["rollouts"]["reward_mean"] == 1.0
    assert report["batch"]["rows"] == 2 * len(tasks)  # the tool call, then the choice


def test_the_apo_room_selector_runs_through_trainer_dev_and_reads_as_messages() -> None:
    tasks = rooms.tasks()[:4]
    with serving(scripted_room_app()) as url:
        trainer = Trainer(
            n_workers=1,
            initial_resources={
                "main_llm": LLM(endpoint=f"{url}/v1", model="scripted"),
                "prompt_template": prompt_template_baseline(),
            },
        )
        report = trainer.dev(room_selector, tasks)

    assert report["rollouts"]["succeeded"] == len(tasks) and report["rollouts"]["reward_mean"] == 1.0
    seen = asyncio.run(dev_rollouts(trainer))
    assert len(seen) == len(tasks)
    for _rollout, transcript in seen:
        tool_call, choice = transcript["messages"]  # one per LLM call, as agl's TraceToMessages gives them
        assert tool_call["tools"][0]["function"]["name"] == "get_rooms_and_availability"
        assert tool_call["messages"][-1]["tool_calls"][0]["function"]["name"] == "get_rooms_and_availability"
        assert choice["messages"][-2]["role"] == "tool" and "final_choice" in choice["messages"][-1]["content"]
        assert transcript["reward"] == 1.0
