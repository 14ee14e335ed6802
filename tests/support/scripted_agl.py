"""Scripted OpenAI-compatible chat endpoints that solve the ported agent-lightning examples' tasks (not models): the
SQL agent's (a reference query per question, a broken one first where asked) and the room selector's (the tool
call, then the smallest free room that fits)."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI


def scripted_chat_app(reply: Callable[[dict[str, Any]], dict[str, Any]]) -> FastAPI:
    """/v1/chat/completions answering each request with the assistant message `reply(body)` (its key
    `finish_reason`, if any, is the choice's); bodies are kept in `app.state.requests`. Token ids come with each
    answer, as vLLM sends them (made up: no model behind them), so that the calls adapt to training rows."""
    app = FastAPI()
    app.state.requests = []
    ids = itertools.count()

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        app.state.requests.append(body)
        message = reply(body)
        finish_reason = message.pop("finish_reason", None) or ("tool_calls" if message.get("tool_calls") else "stop")
        return {
            "id": f"chatcmpl-{next(ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "token_ids": [4, 5],
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    return app


def scripted_sql_app(queries: dict[str, str], broken_first: frozenset[str] = frozenset()) -> FastAPI:
    """Answers each question with its query from `queries`; for questions in `broken_first`, a query that fails
    first, and the right one once told of the error."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        told_of_error = messages[-1]["content"].startswith("The query failed")
        query = "SELECT nothing FROM nowhere" if question in broken_first and not told_of_error else queries[question]
        return {"role": "assistant", "content": f"```sql\n{query}\n```"}

    return scripted_chat_app(reply)


def scripted_room_app() -> FastAPI:
    """Calls get_rooms_and_availability with the request's slot, then picks the smallest free room that fits."""
    ids = itertools.count()

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        messages = body["messages"]
        request = next(m["content"] for m in messages if m["role"] == "user")
        slot = re.search(
            r"Date: (\S+)\. Time: (\S+)\. Duration: (\d+) min\. Attendees: (\d+)\. Needs: (.+)\. Accessible: (\w+)",
            request,
        )
        assert slot is not None, request
        date, time_, duration, attendees, needs, accessible = slot.groups()
        if messages[-1]["role"] != "tool":
            arguments = json.dumps({"date": date, "time": time_, "duration_min": int(duration)})
            call = {
                "id": f"call-{next(ids)}",
                "type": "function",
                "function": {"name": "get_rooms_and_availability", "arguments": arguments},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        wanted = set() if needs == "nothing special" else set(needs.split(", "))
        fitting = [
            room
            for room in json.loads(messages[-1]["content"])
            if room["free"]
            and room["capacity"] >= int(attendees)
            and wanted <= set(room["equipment"])
            and (room["accessible"] or accessible == "no")
        ]
        choice = min(fitting, key=lambda room: room["capacity"])["id"] if fitting else "none"
        return {"role": "assistant", "content": f"{choice} fits best.\nfinal_choice: {choice}"}

    return scripted_chat_app(reply)
