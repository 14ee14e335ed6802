"""Agents that misbehave as users' agents do, each after a real call to the run's LLM (so its rollout has a call
to train on): what the task's `misbehave` says. Importable as `support.misbehaving:<name>`."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

from lightning.agent import rollout
from lightning.tracing import emit_message
from lightning.types import LLM, AttemptedRollout
from support.agents import copy_reward

BAD_REWARDS: dict[str, Any] = {"nan": float("nan"), "inf": float("inf"), "none": None, "string": "0.5", "huge": 1e308}


@rollout
async def misbehaving_agent(task: dict[str, Any], llm: LLM, rollout: AttemptedRollout) -> Any:
    """`misbehave`: a key of BAD_REWARDS (returned as the reward), `hang` (never returns), `raise30` (raises in
    about 30% of rollouts, chosen by the task's letters), `spans` (emits `spans` message spans first), `block`
    (blocks its runner's event loop with `time.sleep(block_seconds)` inside `async def`, on its first
    `block_attempts` attempts: 1 unless the task says); anything else behaves."""
    kind = task.get("misbehave")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "block" and rollout.attempt.sequence_id <= task.get("block_attempts", 1):
        time.sleep(task["block_seconds"])  # BLOCKS: the line the runner's watchdog names
    got = await copy_reward(task, llm)
    if kind in BAD_REWARDS:
        return BAD_REWARDS[kind]
    if kind == "raise30" and zlib.crc32(task["letters"].encode()) % 10 < 3:
        raise RuntimeError(f"the agent's tool failed on {task['letters']!r}")
    if kind == "spans":
        for index in range(task["spans"]):
            emit_message(f"step {index}")
    return got
