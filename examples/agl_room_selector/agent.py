"""A function-calling agent in agent-lightning 0.3's style (its room-selector example's task, our own code): given a
meeting request, the model calls a `get_rooms_and_availability` tool and picks a room. Reward: True when it picks the
best room (the smallest free one that fits the attendees, the equipment and the accessibility needed).

Written as for agent-lightning, its submodule imports changed from `agentlightning.X` to `lightning.X`: a `@rollout`
function taking the task and the `llm`, a bool reward emitted with `emit_reward(..., primary_key=..., attributes=...)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openai import OpenAI

from examples.agl_common import jsonl_tasks
from examples.room_booking.agent import BOOKINGS, describe, final_choice  # the same building, requests and answers
from examples.room_booking.agent import ROOMS as BUILDING
from lightning.emitter import emit_reward
from lightning.litagent import rollout
from lightning.types import LLM

TASKS = Path(__file__).with_name("tasks.jsonl")
MAX_TURNS = 3
ROOMS = [
    {"id": room["name"], "capacity": room["seats"], "equipment": room["equipment"], "accessible": room["accessible"]}
    for room in BUILDING
]
"""examples/room_booking's rooms, in the fields of agent-lightning's room selector (`id`, `capacity`); their bookings
are that example's `BOOKINGS`: (room, date) -> busy (start, end) in minutes after midnight."""
SYSTEM_PROMPT = "Pick the smallest free room that fits. End with final_choice: <room>"
ROOM_TOOL = {
    "type": "function",
    "function": {
        "name": "get_rooms_and_availability",
        "description": "Rooms and whether each is free",
        "parameters": {
            "type": "object",
            "properties": {"date": {"type": "string"}, "time": {"type": "string"}, "duration_min": {"type": "integer"}},
            "required": ["date", "time", "duration_min"],
        },
    },
}


@rollout
def room_selector(task: dict[str, Any], llm: LLM) -> None:
    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "dummy", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": describe(task)},
    ]
    choice, tool_calls = converse(client, llm, messages)
    correct = choice == task["expected_choice"]
    emit_reward(
        {"correct": correct, "used_tool": tool_calls > 0},
        primary_key="correct",
        attributes={"choice": choice or "", "expected": task["expected_choice"]},
    )


def converse(client: OpenAI, llm: LLM, messages: list[dict[str, Any]]) -> tuple[str | None, int]:
    """Ask the model, run the tool calls it makes and tell it their results, until it chooses (at most MAX_TURNS
    calls); its choice (None: it made none) and how many tool calls it made."""
    tool_calls = 0
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(
            model=llm.model, messages=messages, tools=[ROOM_TOOL], **llm.sampling_parameters
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return final_choice(message.content or ""), tool_calls
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)})
    return None, tool_calls


def run_tool(arguments: str) -> str:
    """The tool's reply to the model (errors too, as text)."""
    try:
        given = json.loads(arguments)
        return json.dumps(rooms_and_availability(given["date"], given["time"], int(given["duration_min"])))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def rooms_and_availability(date: str, time: str, duration_min: int) -> list[dict[str, Any]]:
    hours, minutes = (int(part) for part in time.split(":"))
    start = hours * 60 + minutes
    end = start + duration_min
    rooms = []
    for room in ROOMS:
        busy = BOOKINGS.get((room["id"], date), [])
        rooms.append({**room, "free": all(end <= busy_start or start >= busy_end for busy_start, busy_end in busy)})
    return rooms


def best_room(task: dict[str, Any]) -> str | None:
    """The grader's answer: the smallest free room that fits (ties: the first listed)."""
    fitting = [
        room
        for room in rooms_and_availability(task["date"], task["time"], task["duration_min"])
        if room["free"]
        and room["capacity"] >= task["attendees"]
        and set(task["needs"]) <= set(room["equipment"])
        and (room["accessible"] or not task["accessible_required"])
    ]
    return min(fitting, key=lambda room: room["capacity"])["id"] if fitting else None


def tasks() -> list[dict[str, Any]]:
    """Meeting requests, each with the room to choose."""
    return jsonl_tasks(TASKS)


def train_tasks() -> list[dict[str, Any]]:
    return tasks()[:8]


def val_tasks() -> list[dict[str, Any]]:
    return tasks()[8:]
