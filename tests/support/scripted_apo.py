"""A scripted OpenAI-compatible server that stands in for both models of prompt optimisation, with no network:
the agent's model (any model name but `optimizer`) and the optimiser (`optimizer`, reached through LiteLLM as
`openai/optimizer`). Its answers depend on the prompt in a stated way:

- **the agent's model** reads the room-booking request and the rooms' table of `examples/room_booking/agent.py`'s
  prompt, keeps the free rooms that fit (seats, equipment, access), and answers `final_choice: <room>` with the
  *smallest* of them when the prompt contains the word "smallest", and the *largest* otherwise. The grader wants the
  smallest, so the seed prompt (which never says "smallest") is right only where one room fits.
- **the optimiser**, asked for a critique (a request without `<critique>`), says that the prompt never says which
  fitting room to choose. Asked for an edit (`<critique>` and "variant k of n" in the request), it returns the
  prompt between `<prompt>` tags with one sentence added before its last paragraph: for odd k, "Of the free rooms
  that fit, choose the smallest." (the edit that raises the reward to 1.0); for even k, "Think step by step." (an
  edit that changes nothing).

`app.state.requests` keeps every request body, in order.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

from fastapi import FastAPI

OPTIMIZER = "optimizer"
GOOD_EDIT = "Of the free rooms that fit, choose the smallest."
NEUTRAL_EDIT = "Think step by step."
CRITIQUE = (
    "The prompt never says which of the rooms that fit to choose, so the agent picked a large one where the "
    "smallest free room that fits was wanted. It should say: of the free rooms that fit, choose the smallest."
)
ROOM = re.compile(r"^- (\w+): seats (\d+); equipment: ([^;]*); accessible: (yes|no); free: (yes|no)$", re.MULTILINE)
REQUEST = re.compile(r"Attendees: (\d+)\. Needs: ([^.]*)\. Accessible: (yes|no)")


def scripted_apo_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    ids = itertools.count()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "policy", "object": "model"}, {"id": OPTIMIZER, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        app.state.requests.append(body)
        prompt = "\n".join(str(message.get("content") or "") for message in body["messages"])
        text = optimizer_answer(prompt) if body["model"] == OPTIMIZER else agent_answer(prompt)
        return {
            "id": f"chatcmpl-{next(ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    return app


def agent_answer(prompt: str) -> str:
    request = REQUEST.search(prompt)
    if request is None:
        return "I cannot read the request. final_choice: none"
    attendees, needs, access = int(request.group(1)), request.group(2), request.group(3) == "yes"
    wanted = set() if needs == "nothing special" else {need.strip() for need in needs.split(",")}
    fitting = [
        (int(seats), name)
        for name, seats, equipment, accessible, free in ROOM.findall(prompt)
        if free == "yes"
        and int(seats) >= attendees
        and wanted <= {item.strip() for item in equipment.split(",")}
        and (accessible == "yes" or not access)
    ]
    if not fitting:
        return "No room fits. final_choice: none"
    smallest = "smallest" in prompt.lower()
    seats, name = min(fitting) if smallest else max(fitting)
    return f"{name} seats {seats} and is free.\nfinal_choice: {name}"


def optimizer_answer(prompt: str) -> str:
    if "<critique>" not in prompt:
        return CRITIQUE
    template = re.search(r"<prompt>\n(.*?)\n</prompt>", prompt, flags=re.DOTALL)
    variant = re.search(r"variant (\d+) of", prompt)
    if template is None or variant is None:
        return "I cannot find the prompt."
    sentence = GOOD_EDIT if int(variant.group(1)) % 2 else NEUTRAL_EDIT
    head, sep, last = template.group(1).rpartition("\n\n")
    edited = f"{head}\n\n{sentence} {last}" if sep else f"{last} {sentence}"
    return f"Here is the improved prompt.\n<prompt>\n{edited}\n</prompt>"
