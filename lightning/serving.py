"""Serve an ASGI app with uvicorn on a background thread of this process (the proxy, the embedded
inference server), and the rules every server we start follows: loopback unless a token guards it, and the
bearer-token check itself."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


class BearerAuth:
    """ASGI middleware: every HTTP request, but those to `open_paths` or below `open_prefixes`, must carry
    `Authorization: Bearer <token>` (compared in constant time); any other gets `refusal()`, a 401 in the server's
    own error shape. Plain ASGI: Starlette's BaseHTTPMiddleware costs about 0.3 ms a call."""

    def __init__(
        self,
        app: Any,
        token: str,
        refusal: Callable[[], Any],
        open_paths: Collection[str] = (),
        open_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.refusal = refusal
        self.open_paths = frozenset(open_paths)
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        guarded = path not in self.open_paths and not path.startswith(self.open_prefixes)
        if scope["type"] in ("http", "websocket") and guarded:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await self.refusal()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body over the server's limit: answered 413."""


async def read_body(request: Any) -> bytes:
    """A Starlette request's body, refused (BodyTooLarge) past the app's `state.max_body_bytes`, by its declared
    length or as read."""
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is {int(declared):,} bytes; this server takes at most {limit:,}")
    body = await request.body()
    if len(body) > limit:
        raise BodyTooLarge(f"the request body is {len(body):,} bytes; this server takes at most {limit:,}")
    return body


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn on its own thread and event loop. `start()` returns once it accepts connections;
    `call(coro)` runs a coroutine on the server's loop from any other thread."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.url} stopped while starting (is the port taken?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on {self.url} did not start within {timeout}s")
            time.sleep(0.01)
        self._loop = self._find_loop()
        return self.url

    def _find_loop(self) -> asyncio.AbstractEventLoop:
        # uvicorn runs its server under asyncio.run on our thread; its loop is where servers live.
        for server in self._server.servers:
            return server.get_loop()
        raise RuntimeError("uvicorn started without a listening socket")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
