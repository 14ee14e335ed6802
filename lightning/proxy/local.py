"""The LLM proxy's calls to an inference server of its own process, without HTTP.

When the proxy and the embedded inference server serve from one process (`python -m lightning.stack`, a run's
`inference.with_proxy`), the proxy hands each call to the server's ASGI app directly: no socket, no request written
by aiohttp and parsed by uvicorn, no response written and parsed back. The two processes' 0.97-1.00 ms of CPU a
rollout became 0.76-0.84 in one (docs/benchmarks.md, "The rollout path's CPU").

`InProcessSession` stands where the proxy's aiohttp session does, and answers with what the proxy reads of an aiohttp
response: `status`, `headers`, `read()`, `json()`, `release()`, `content.iter_any()` and `content.at_eof()`. The app
runs as a task of the proxy's loop, as uvicorn would run it: an app that raises before answering is a 500 (logged),
one that raises mid-body breaks the body off (`aiohttp.ClientPayloadError`, as a dropped connection does); releasing
a response before its end disconnects the app (a stream being generated stops, as when the proxy closes a
connection).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Generator
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
from multidict import CIMultiDict
from starlette.responses import Response

from lightning.mailbox import Mailbox

logger = logging.getLogger(__name__)

_END = object()


class InProcessSession:
    """Calls to the ASGI `app` as an aiohttp session makes them over HTTP; `timeout`: seconds a call may take, to
    the end of its body (the proxy's session timeout)."""

    def __init__(self, app: Any, timeout: float) -> None:
        self.app = app
        self.timeout = timeout
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, url: str, *, data: bytes, headers: dict[str, str], **_: Any) -> _Pending:
        return _Pending(self._call("POST", url, data, headers))

    def get(self, url: str, *, headers: dict[str, str], **_: Any) -> _Pending:
        return _Pending(self._call("GET", url, b"", headers))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _call(self, method: str, url: str, body: bytes, headers: dict[str, str]) -> InProcessResponse:
        sent = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            **_url_scope(url), "root_path": "", "headers": [*sent, (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 0),
        }  # fmt: skip
        route = getattr(self.app, "route", None)  # `lightning.serving.past_guards`' entry: the app's hot routes
        found = route(scope) if route is not None else None
        if found is not None:
            return await self._call_hot(found, scope, body)
        return await self._start(self.app, scope, body, self.timeout)

    async def _start(self, app: Any, scope: dict[str, Any], body: bytes, timeout: float) -> InProcessResponse:
        """Run `app` on the request as a task of this loop; its response once it starts answering."""
        loop = asyncio.get_running_loop()
        response = InProcessResponse(loop, timeout)
        task = loop.create_task(self._run(app, scope, body, response))
        response._task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            await response._started
        except BaseException:  # it failed or timed out, or the proxy's call was cancelled: the app's call goes too
            response.release()
            raise
        return response

    async def _call_hot(self, found: Any, scope: dict[str, Any], body: bytes) -> InProcessResponse:
        """A hot route's call (every chat completion of a rollout): its handler awaited here and its whole answer
        handed back as it is, with no task, ASGI messages or queue of body chunks between (56.6 -> 35.8 us a call
        around a stand-in handler of 9: benchmarks/call_paths.py). What the handler raises is answered as the app's
        call would be; a streamed answer is sent on as the app sends it, in the time left."""
        request = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return request.pop() if request else {"type": "http.disconnect"}

        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                answer = await self.app.answer(found, scope, receive)
        except TimeoutError:
            if not deadline.expired():
                return self._failed(scope)  # the handler's own TimeoutError, a 500 as any other of its errors
            raise TimeoutError(f"the in-process app took over {self.timeout:g} s") from None
        except Exception:
            return self._failed(scope)
        if not isinstance(answer, Response) or not hasattr(answer, "body") or answer.background is not None:
            # A stream (its body is not there yet), or work to do after answering: sent on as the app sends it.
            return await self._start(answer, scope, b"", max(self.timeout - (time.monotonic() - started), 0.001))
        return InProcessResponse.whole(answer.status_code, answer.raw_headers, answer.body)

    def _failed(self, scope: dict[str, Any]) -> InProcessResponse:
        """What uvicorn answers for an app that raised before answering: a 500, the error logged."""
        logger.exception("the in-process inference server failed on %s %s", scope["method"], scope["path"])
        return InProcessResponse.whole(500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error")

    async def _run(self, app: Any, scope: dict[str, Any], body: bytes, response: InProcessResponse) -> None:
        request = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if request:
                return request.pop()
            await response._until_released()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                pairs = message["headers"]
                response.headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in pairs)
                response.status = message["status"]
                response._start()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    response._put(message["body"])
                if not message.get("more_body", False):
                    response._put(_END)

        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not response._started.done():  # what uvicorn answers for an app that raised before answering
                logger.exception("the in-process inference server failed on %s %s", scope["method"], scope["path"])
                response.status, response.headers = 500, CIMultiDict({"content-type": "text/plain; charset=utf-8"})
                response._put(b"Internal Server Error")
                response._start()
            else:
                response._put(aiohttp.ClientPayloadError(f"the response broke off: {exc!r}"))
        finally:
            # As a server that closed the connection without answering, or without ending its body.
            response._start(aiohttp.ServerDisconnectedError("the in-process app ended without answering"))
            response._put(_END)


@functools.lru_cache(maxsize=64)
def _url_scope(url: str) -> dict[str, Any]:
    """The ASGI scope's fields of a URL (the proxy calls the few of its backend's routes)."""
    parts = urlsplit(url)
    return {
        "path": unquote(parts.path), "raw_path": parts.path.encode(), "query_string": parts.query.encode(),
        "server": (parts.hostname, parts.port),
    }  # fmt: skip


class _Pending:
    """What `post` and `get` return: awaited, the response; in `async with`, the response, released at the end."""

    def __init__(self, call: Awaitable[InProcessResponse]) -> None:
        self._call = call
        self._response: InProcessResponse | None = None

    def __await__(self) -> Generator[Any, None, InProcessResponse]:
        return self._call.__await__()

    async def __aenter__(self) -> InProcessResponse:
        self._response = await self._call
        return self._response

    async def __aexit__(self, *exc: object) -> None:
        if self._response is not None:
            self._response.release()


class InProcessResponse:
    """An answer of the in-process app, read as the proxy reads an aiohttp response."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content = self  # `upstream.content.iter_any()`, as on aiohttp's
        self._loop = loop
        self._started: asyncio.Future[None] = loop.create_future()
        self._chunks: Mailbox[Any] = Mailbox(loop)  # the body's chunks as the app sends them
        self._released = False
        self._release_seen: asyncio.Future[None] | None = None
        self._ended = False
        self._task: asyncio.Task[None] | None = None
        self._timer = None if timeout is None else loop.call_later(timeout, self._time_out, timeout)
        self._whole: bytes | None = None

    @classmethod
    def whole(cls, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes) -> InProcessResponse:
        """An answer already complete: its status, headers (as ASGI's) and body."""
        response = cls(asyncio.get_running_loop(), None)
        response.status = status
        response.headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers)
        if body:
            response._put(body)
        response._put(_END)
        response._whole = body
        response._start()
        return response

    async def iter_any(self) -> AsyncIterator[bytes]:
        self._whole = None  # read in chunks
        while not self._ended:
            chunk = await self._chunks.get()
            if chunk is _END or isinstance(chunk, BaseException):
                self._ended = True
                if self._timer is not None:
                    self._timer.cancel()
                if chunk is not _END:
                    raise chunk
            else:
                yield chunk

    def at_eof(self) -> bool:
        return self._ended

    async def read(self) -> bytes:
        if self._whole is not None and not self._ended:  # `whole`'s, unread: the body is here
            self._ended, body, self._whole = True, self._whole, None
            return body
        return b"".join([chunk async for chunk in self.iter_any()])

    async def json(self, content_type: str | None = None) -> Any:
        return json.loads(await self.read())

    def release(self) -> None:
        """Done with the answer: an app still answering sees its client gone, and is stopped."""
        if self._timer is not None:
            self._timer.cancel()
        self._released = True
        if self._release_seen is not None and not self._release_seen.done():
            self._release_seen.set_result(None)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _put(self, chunk: Any) -> None:
        self._chunks.put(chunk)

    async def _until_released(self) -> None:
        if not self._released:
            self._release_seen = self._release_seen or self._loop.create_future()
            await self._release_seen

    def _start(self, failure: BaseException | None = None) -> None:
        if self._started.done():
            return
        if failure is None:
            self._started.set_result(None)
        else:
            self._started.set_exception(failure)

    def _time_out(self, timeout: float) -> None:
        """The call's `timeout` passed: TimeoutError to whoever waits for its answer or its body, as aiohttp's."""
        error = TimeoutError(f"the in-process app took over {timeout:g} s")
        if self._started.done():
            self._put(error)
        else:
            self._start(error)
        if self._task is not None and not self._task.done():
            self._task.cancel()
