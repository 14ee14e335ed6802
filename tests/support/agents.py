"""Agents for runner tests; importable by runner subprocesses as `support.agents:<name>`."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.agent import rollout
from lightning.types import AttemptedRollout


@rollout
def counting_agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
    """Logs each execution (rollout id, attempt number, pid) to $LIGHTNING_TEST_LOG, sleeps as the
    task says, and hangs on its first attempt when the task says `hang_first_attempt`."""
    log = os.environ.get("LIGHTNING_TEST_LOG")
    if log:
        with open(log, "a") as out:  # O_APPEND: whole lines from several processes
            out.write(f"{rollout.rollout_id} {rollout.attempt.sequence_id} {os.getpid()}\n")
    if task.get("hang_first_attempt") and rollout.attempt.sequence_id == 1:
        time.sleep(600)
    time.sleep(task.get("sleep", 0.0))
    return float(task.get("reward", 1.0))


def half_flat_tasks() -> list[dict[str, Any]]:
    """Eight tasks, two of which `half_flat_agent` scores differently from sample to sample."""
    return [{"name": f"task-{i}", "mixed": i in (2, 5)} for i in range(8)]


@rollout
def half_flat_agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
    """Reward by the sample's parity on a `mixed` task (its group's rewards differ), 1.0 on any other (a flat
    group: every sample alike)."""
    return float(rollout.metadata["sample"] % 2) if task["mixed"] else 1.0


@rollout
async def slow_copy_agent(task: dict[str, Any], llm: Any) -> float:
    """The copy task's agent, a quarter of a second slower per rollout: a window to stop a run in its rollouts."""
    import asyncio

    await asyncio.sleep(0.25)
    return await copy_reward(task, llm)


@rollout
async def paced_copy_agent(task: dict[str, Any], llm: Any) -> float:
    """The copy task's agent, 50 ms slower per rollout ($LIGHTNING_TEST_PACE_SECONDS, where set): an iteration's
    rollouts, two at a time, then take a second or more, however fast the real agent gets: a window in which a fault
    test sees them part done."""
    import asyncio

    await asyncio.sleep(float(os.environ.get("LIGHTNING_TEST_PACE_SECONDS", "0.05")))
    return await copy_reward(task, llm)


@rollout
async def pid_copy_agent(task: dict[str, Any], llm: Any) -> float:
    """The copy task's agent, writing the process id it runs in to $LIGHTNING_TEST_LOG (a line a rollout), and 50
    ms slower: where a run's agents run, and a window to stop or kill them in."""
    import asyncio

    log = os.environ.get("LIGHTNING_TEST_LOG")
    if log:
        with open(log, "a") as out:  # O_APPEND: whole lines from several processes
            out.write(f"{os.getpid()}\n")
    await asyncio.sleep(0.05)
    return await copy_reward(task, llm)


async def copy_reward(task: dict[str, Any], llm: Any) -> float:
    """One call of the copy task's agent to `llm`: its reward."""
    import httpx
    from openai import AsyncOpenAI

    from examples.copy_task.agent import reward

    async with httpx.AsyncClient(timeout=60) as http:
        client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0, http_client=http)
        response = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["letters"]}], **llm.sampling_parameters
        )
    return reward(response.choices[0].message.content or "", task["target"])
