"""The room selector as agent-lightning's APO example writes it (our own code): the user message comes from a
`PromptTemplate` resource, which prompt optimisation tunes, and the agent calls its `get_rooms_and_availability`
tool before it chooses. Reward: 1.0 for the best room (the smallest free one that fits), else 0.0.

Only its import lines differ from agent-lightning code (`agentlightning.litagent`, `.types`, `.adapter`, `.store`
and `.reward` become `lightning.*`). `transcripts` shows a rollout as prompt optimisation reads it: `TraceToMessages`
turns its spans into chat transcripts. Its LLM calls are the ones the run's LLM proxy records, so the agent calls
the `llm` resource (agl's example calls OpenAI() and lets its tracer instrument the client). The rooms, the tool and
its tool loop are examples/agl_room_selector's.
"""

from __future__ import annotations

from typing import Any

from openai import OpenAI

from examples.agl_room_selector.agent import best_room, converse
from lightning.adapter import TraceToMessages
from lightning.litagent import rollout
from lightning.reward import find_final_reward
from lightning.store import LightningStore
from lightning.types import LLM, PromptTemplate


def prompt_template_baseline() -> PromptTemplate:
    return PromptTemplate(
        template="Date: {date}. Time: {time}. Duration: {duration_min} min. Attendees: {attendees}. "
        "Needs: {needs}. Accessible: {accessible}.",
        engine="f-string",
    )


@rollout
def room_selector(task: dict[str, Any], prompt_template: PromptTemplate, llm: LLM) -> float:
    client = OpenAI(base_url=llm.endpoint, api_key="dummy", max_retries=0)
    needs = ", ".join(task["needs"]) or "nothing special"
    user_message = prompt_template.format(
        date=task["date"],
        time=task["time"],
        duration_min=task["duration_min"],
        attendees=task["attendees"],
        needs=needs,
        accessible="yes" if task["accessible_required"] else "no",
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a scheduling assistant. End with final_choice: <room>"},
        {"role": "user", "content": user_message},
    ]
    choice, _ = converse(client, llm, messages)
    return 1.0 if choice is not None and choice == best_room(task) else 0.0


async def transcripts(store: LightningStore, rollout_id: str) -> dict[str, Any]:
    """One rollout as prompt optimisation reads it: its LLM calls as chat transcripts (TraceToMessages), tool calls
    and tools included, and its final reward."""
    spans = await store.query_spans(rollout_id)
    return {"messages": TraceToMessages().adapt(spans), "reward": find_final_reward(spans)}
