"""A fast OpenAI-shaped backend with a fixed answer, for proxy tests and the proxy benchmark.

It is a bare ASGI app (no framework), so that what a benchmark measures is the proxy, not this
backend. It answers /v1/chat/completions and /v1/completions, streaming or not, with vLLM's token-id
fields when asked (`return_token_ids`), the sampled tokens' log-probs when asked (`logprobs`), and can be
told to fail: `state.fail_next = k` makes the next k calls answer 500.
Run it as a process: `python fixed_backend.py PORT`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

PROMPT_IDS = [101, 7, 42, 9, 250, 3, 1000, 65535]
ANSWER = ["The", " answer", " is", " 4", "."]
ANSWER_IDS = [17, 305, 9, 62, 13]
ANSWER_LOGPROBS = [-0.5, -1.25, -0.125, -2.0, -0.0625]
"""Exact in float32, as the proxy stores them."""


def _wants_logprobs(body: dict[str, Any]) -> bool:
    """Chat asks with `logprobs: true`, completions with a number (0 included)."""
    return body.get("logprobs") is not None and body.get("logprobs") is not False


def _logprobs(chat: bool, positions: range) -> dict[str, Any]:
    """A choice's `logprobs` for the answer's tokens at `positions`, in chat's or completions' shape."""
    if chat:
        return {"content": [{"token": ANSWER[i], "logprob": ANSWER_LOGPROBS[i], "top_logprobs": []} for i in positions]}
    return {"tokens": [ANSWER[i] for i in positions], "token_logprobs": [ANSWER_LOGPROBS[i] for i in positions]}


class FixedBackend:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0
        self.stream_delay = 0.0
        self.served_models: list[str] = []
        """What GET /v1/models lists; empty: that route answers 404, as some servers do."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/health":
            await _send(send, 200, b'{"status":"ok"}')
            return
        if path == "/v1/models" and scope["method"] == "GET":  # not a call: not recorded, never failed
            if not self.served_models:
                await _send(send, 404, b'{"error":{"message":"no such route","code":404}}')
            else:
                data = [{"id": name, "object": "model", "owned_by": "fixed"} for name in self.served_models]
                await _send(send, 200, json.dumps({"object": "list", "data": data}).encode())
            return
        body = json.loads(raw) if raw else {}
        self.requests.append(body)
        if self.fail_next > 0:
            self.fail_next -= 1
            await _send(send, 500, b'{"error":{"message":"injected failure","type":"APIError","code":500}}')
            return
        chat = path == "/v1/chat/completions"
        if not chat and path != "/v1/completions":
            await _send(send, 404, b'{"error":{"message":"no such route","code":404}}')
            return
        token_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            await self._stream(send, body, chat, token_ids)
        else:
            await _send(send, 200, json.dumps(_whole(body, chat, token_ids)).encode())

    async def _stream(self, send: Any, body: dict[str, Any], chat: bool, token_ids: bool) -> None:
        import asyncio

        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, (text, token) in enumerate(zip(ANSWER, ANSWER_IDS, strict=True)):
            last = i == len(ANSWER) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if last else None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if i == 0 else {"content": text}
            else:
                choice["text"] = text
            if _wants_logprobs(body):
                choice["logprobs"] = _logprobs(chat, range(i, i + 1))
            chunk: dict[str, Any] = {"id": "fixed-1", "object": "chunk", "created": 0, "model": body.get("model")}
            if token_ids:
                choice["token_ids"] = [token]
                if i == 0:
                    (chunk if chat else choice)["prompt_token_ids"] = PROMPT_IDS
            chunk["choices"] = [choice]
            if last:
                chunk["usage"] = _usage()
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True,
                }
            )
            if self.stream_delay:
                await asyncio.sleep(self.stream_delay)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _whole(body: dict[str, Any], chat: bool, token_ids: bool) -> dict[str, Any]:
    text = "".join(ANSWER)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    response: dict[str, Any] = {"id": "fixed-1", "created": int(time.time()), "model": body.get("model")}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        response["object"] = "chat.completion"
    else:
        choice["text"] = text
        response["object"] = "text_completion"
    if _wants_logprobs(body):
        choice["logprobs"] = _logprobs(chat, range(len(ANSWER)))
    if token_ids:
        choice["token_ids"] = ANSWER_IDS
        if chat:
            response["prompt_token_ids"] = PROMPT_IDS
        else:
            choice["prompt_token_ids"] = PROMPT_IDS
    response["choices"] = [choice]
    response["usage"] = _usage()
    return response


def _usage() -> dict[str, int]:
    return {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(ANSWER_IDS), "total_tokens": 13}


async def _send(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(FixedBackend(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
