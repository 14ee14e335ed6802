"""The calculator agent (two LLM calls a rollout: the tool call, then the answer) run by a runner through the LLM
proxy to a given inference server, and its rollouts adapted into trajectory rows: the multi-turn path end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples.calculator.agent import calculator_agent, load_tasks
from lightning.adapter import AdaptResult, adapt_rollouts
from lightning.proxy import Backend, LLMProxy
from lightning.runner import Runner
from lightning.store import SqlLightningStore
from lightning.types import Span


async def calculator_through_proxy(
    backend: str | Backend, store_path: Path, *, tokenizer: Any, tasks: int = 2
) -> tuple[AdaptResult, list[Span]]:
    """Greedy rollouts of the first `tasks` calculator tasks; the trajectory adapter's result and their spans. The
    proxy joins turns token-exactly when it has `tokenizer` (a model directory)."""
    chosen = load_tasks()[:tasks]
    store = SqlLightningStore(f"sqlite:///{store_path}", watchdog_interval=None)
    try:
        proxy = LLMProxy(store, [backend], model_name="tiny", tokenizer=tokenizer)
        proxy.start()
        try:
            llm = proxy.resource().model_copy(update={"sampling_parameters": {"temperature": 0.0}})
            await store.add_resources({"main_llm": llm})
            queued = await store.enqueue_many_rollouts([{"input": task} for task in chosen])
            runner = Runner(calculator_agent, store, idle_wait=0.05)
            assert await runner.iter(max_rollouts=len(chosen)) == len(chosen)
            await runner.close()
        finally:
            proxy.stop()
        ids = [rollout.rollout_id for rollout in queued]
        adapted = await adapt_rollouts(store, ids, shape="trajectory")
        spans = [span for rollout_id in ids for span in await store.query_spans(rollout_id)]
        return adapted, spans
    finally:
        await store.close()
