"""A room-booking agent with a tunable prompt, for prompt optimisation (APO, the `optimize_prompt` flow).

Given a meeting request and the rooms' availability, the model picks a room. The prompt is the `prompt_template`
resource: its text is what APO tunes, its placeholders `{request}` and `{rooms}` are what the agent fills in.
Reward 1.0 when the model picks the room the grader would: the smallest free room that seats the attendees, has the
equipment asked for and is wheelchair accessible when that is required (ties: the first listed).

    python -m flows.dev examples/room_booking/apo.yaml               # one batch on the seed prompt, no optimiser
    python -m flows.optimize_prompt examples/room_booking/apo.yaml   # APO (OPENAI_API_KEY, or any LiteLLM model)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from lightning.agent import rollout
from lightning.types import LLM, PromptTemplate

HERE = Path(__file__).parent
INITIAL_PROMPT = """You book meeting rooms.

Request: {request}

Rooms:
{rooms}

Choose a room for the meeting. End your answer with `final_choice: <room name>`."""
"""The seed prompt: it never says which of the rooms that fit to choose."""

ROOMS = [
    {"name": "Lyra", "seats": 4, "equipment": ["screen"], "accessible": True},
    {"name": "Orion", "seats": 6, "equipment": ["projector", "whiteboard"], "accessible": False},
    {"name": "Vega", "seats": 8, "equipment": ["projector"], "accessible": True},
    {"name": "Atlas", "seats": 12, "equipment": ["projector", "whiteboard", "screen"], "accessible": True},
    {"name": "Nova", "seats": 20, "equipment": ["projector", "microphone"], "accessible": True},
]
BOOKINGS = {  # (room, date) -> busy (start, end), minutes after midnight
    ("Lyra", "2025-10-13"): [(540, 600)],
    ("Orion", "2025-10-13"): [(600, 720)],
    ("Vega", "2025-10-13"): [(780, 840)],
    ("Atlas", "2025-10-14"): [(540, 1020)],
    ("Vega", "2025-10-14"): [(600, 660)],
    ("Nova", "2025-10-15"): [(480, 720)],
}


@rollout
async def room_booking(task: dict[str, Any], llm: LLM, prompt_template: PromptTemplate) -> float:
    prompt = prompt_template.format(request=describe(task), rooms=availability(task))
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0) as client:
        response = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": prompt}], **llm.sampling_parameters
        )
    return 1.0 if final_choice(response.choices[0].message.content or "") == task["expected_choice"] else 0.0


def describe(task: dict[str, Any]) -> str:
    needs = ", ".join(task["needs"]) or "nothing special"
    access = "yes" if task["accessible_required"] else "no"
    return (
        f"Date: {task['date']}. Time: {task['time']}. Duration: {task['duration_min']} min. "
        f"Attendees: {task['attendees']}. Needs: {needs}. Accessible: {access}."
    )


def availability(task: dict[str, Any]) -> str:
    """One line per room: seats, equipment, access, and whether it is free for the meeting."""
    lines = []
    for room in rooms_for(task):
        equipment = ", ".join(room["equipment"]) or "none"
        lines.append(
            f"- {room['name']}: seats {room['seats']}; equipment: {equipment}; "
            f"accessible: {'yes' if room['accessible'] else 'no'}; free: {'yes' if room['free'] else 'no'}"
        )
    return "\n".join(lines)


def rooms_for(task: dict[str, Any]) -> list[dict[str, Any]]:
    hours, minutes = (int(part) for part in task["time"].split(":"))
    start = hours * 60 + minutes
    end = start + task["duration_min"]
    return [
        {
            **room,
            "free": all(end <= busy[0] or start >= busy[1] for busy in BOOKINGS.get((room["name"], task["date"]), [])),
        }
        for room in ROOMS
    ]


def best_room(task: dict[str, Any]) -> str | None:
    """The grader's answer: the smallest free room that fits (ties: the first listed)."""
    fitting = [
        room
        for room in rooms_for(task)
        if room["free"]
        and room["seats"] >= task["attendees"]
        and set(task["needs"]) <= set(room["equipment"])
        and (room["accessible"] or not task["accessible_required"])
    ]
    return min(fitting, key=lambda room: room["seats"])["name"] if fitting else None


def final_choice(text: str) -> str | None:
    found = re.findall(r"final_choice:\s*`?\*{0,2}([A-Za-z]+)", text)
    return found[-1].capitalize() if found else None


def _load(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def train_tasks() -> list[dict[str, Any]]:
    return _load("train.jsonl")


def val_tasks() -> list[dict[str, Any]]:
    return _load("val.jsonl")
