"""Agents that make their own OpenAI clients, as agent-lightning's apo examples do, in runner threads.

- An agent that makes an `AsyncOpenAI()` in each rollout and drops it (`apo_rollout` and its judge), run by a runner
  task's fleet on a real SQLite store: a dropped client that only the cyclic garbage collector frees (the SDK's
  objects hold reference cycles) is closed on the fleet's own loop when the fleet ends. Freed later, on another loop
  (the flow's), its closing would fail with "Event loop is closed", which asyncio logs as an error ("Task exception
  was never retrieved") in a run that went well.
- An agent's first use of the SDK (`client.chat`, which imports the SDK's resources) in one runner thread while
  another arms the tracer's OpenAI instrumentation (which imports the modules it wraps) raised _DeadlockError in
  the agent (agl's room_selector_apo.py with n_runners=8 lost an attempt to it): checked in fresh interpreters,
  where the SDK's resources are not imported yet.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from support.scripted_agl import scripted_chat_app
from support.servers import serving

from lightning.agent import rollout
from lightning.runner.fleet import run_fleet_until
from lightning.store import SqlLightningStore
from lightning.tracing import find_final_reward
from lightning.types import RolloutConfig

QUEUE = "own-clients"
ROOT = Path(__file__).parents[1]
RACE = ROOT / "tests" / "support" / "openai_import_race.py"


@rollout
async def own_client_agent(task: dict[str, Any]) -> float:
    """Calls the endpoint with a client of its own, which it leaves in a reference cycle (as the SDK's objects
    may be), so that only the cyclic collector frees it, after the rollout."""
    client = AsyncOpenAI(base_url=task["endpoint"], api_key="dummy", max_retries=0)
    client.own_cycle = client  # type: ignore[attr-defined]
    answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if answer.choices[0].message.content == "hello" else 0.0


async def test_an_agent_s_dropped_clients_are_closed_on_the_fleet_s_loop(tmp_path: Path) -> None:
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db")
    try:
        with serving(scripted_chat_app(lambda body: {"role": "assistant", "content": "hello"})) as url:
            tasks = [{"endpoint": f"{url}/v1", "q": f"hi {n}"} for n in range(3)]
            queued = await store.enqueue_many_rollouts(
                [{"input": task, "config": RolloutConfig(), "queue": QUEUE} for task in tasks]
            )
            ids = [rollout.rollout_id for rollout in queued]
            done = await run_fleet_until(
                own_client_agent, store, ids, queue=QUEUE, concurrency=2, index=0, timeout=60, blocked_after=30,
                on_rollout_end=lambda: None,
            )  # fmt: skip
            # What the clients left would be finalised here, on this loop, were they garbage still.
            gc.collect()
            for _ in range(5):
                await asyncio.sleep(0.05)
            gc.collect()
        assert done["finished"] == 3
        for rollout_id in ids:
            spans = await store.query_spans(rollout_id)
            assert find_final_reward(spans) == 1.0
            assert any(span.name == "openai.chat.completion" for span in spans), [span.name for span in spans]
        assert loop_errors == []
    finally:
        await store.close()


@pytest.mark.slow
def test_a_first_use_of_the_sdk_while_another_thread_arms_the_instrumentation_does_not_deadlock() -> None:
    # Before the fix, about half of such interpreters had a thread fail with _DeadlockError; six are run.
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, str(RACE)], capture_output=True, text=True, timeout=120, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome == {"errors": [], "instrumented": True}, outcome
