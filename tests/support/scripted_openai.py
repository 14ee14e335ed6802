"""A scripted OpenAI-compatible chat endpoint for agent tests: it calls the calculator tool on the
question's expression, then answers with the tool's result. Not a model; the embedded inference
server replaces it once it exists."""

from __future__ import annotations

import itertools
import json
import re
import time
from typing import Any

from fastapi import FastAPI


def scripted_calculator_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    ids = itertools.count()

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        app.state.requests.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            message: dict[str, Any] = {"role": "assistant", "content": f"The answer is {last['content']}."}
            finish = "stop"
        else:
            expression = re.search(r"What is (.+)\?", last["content"])
            arguments = json.dumps({"expression": expression.group(1) if expression else "0"})
            function = {"name": "calculator", "arguments": arguments}
            call = {"id": f"call-{next(ids)}", "type": "function", "function": function}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-{next(ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    return app
