"""Serve an ASGI app with uvicorn on a background thread of this process (the proxy, the embedded
inference server), and the rules every server we start follows: loopback unless a token guards it, and the
bearer-token check itself."""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest request body a server of ours takes by default (the store's, the proxy's, the inference server's)."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for the httpx clients this process makes per call (`verify=tls_context()`), with httpx's own
    defaults (certifi's CA bundle, SSL_CERT_FILE). httpx builds a context for every client, whatever its URLs' scheme,
    and loading the CA bundle costs 20 ms of CPU: the run's three calls to its own plain-HTTP servers a checkpoint
    were 9% of the flow's process's CPU in a profile (issue 39)."""
    import httpx

    return httpx.create_ssl_context()


def freeze_startup_objects() -> None:
    """Keep what imports and start-up made out of the garbage collector's passes, in a long-lived process (a
    server, a runner process). A server imports FastAPI, SQLAlchemy, pydantic and OpenTelemetry (the inference
    server torch besides): a full pass over all that, which any request allocating a few thousand objects sets off
    now and then, cost more than the request itself (measured in the store's server: 0.39 s of 0.47 s spent building
    a batch's models). A runner process's fleet ends with a full pass (`lightning.runner.blocking`): 55-67 ms over
    the 87,000 objects of its imports, twice a phase, until frozen. (An open run freezes its process's objects
    until it closes: `Run.open`.)"""
    gc.collect()
    gc.freeze()


def without_fastapi_telemetry() -> dict[str, Any]:
    """`FastAPI(**without_fastapi_telemetry())`: FastAPI's own OpenTelemetry instrumentation (FastAPI 0.150 and
    later) off. Our servers trace what they mean to through private providers (a span per LLM call, never one per
    HTTP request: a proxy route's path carries its signature); FastAPI's would export request spans to whatever
    global provider a library set, and looks the global providers up on every request (three environment variables
    that are not set, each a KeyError inside `os.environ`: 6% of the proxy's CPU in a profile, issue 39)."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


class BearerAuth:
    """ASGI middleware: every HTTP request, but those to `open_paths` or below `open_prefixes` or whose path
    `admit(path)` vouches for (a route signed with the token), must carry `Authorization: Bearer <token>` (compared
    in constant time); any other gets `refusal()`, a 401 in the server's own error shape. Plain ASGI: Starlette's
    BaseHTTPMiddleware costs about 0.3 ms a call."""

    def __init__(
        self,
        app: Any,
        token: str,
        refusal: Callable[[], Any],
        open_paths: Collection[str] = (),
        open_prefixes: tuple[str, ...] = (),
        admit: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.admit = admit
        self.expected = f"Bearer {token}".encode()
        self.refusal = refusal
        self.open_paths = frozenset(open_paths)
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        guarded = path not in self.open_paths and not path.startswith(self.open_prefixes)
        if scope["type"] in ("http", "websocket") and guarded:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected) and not (self.admit is not None and self.admit(path)):
                await self.refusal()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def too_large(size: int, limit: int, *, declared: bool, setting: str) -> str:
    """The 413's message: the body's size, the limit, and the setting that raises it."""
    how = "is" if declared else "is over"
    return (
        f"the request body {how} {size:,} bytes; this server takes at most {limit:,} bytes ({limit / 2**20:.3g} MB), "
        f"set by {setting}"
    )


CLIENT_GONE = "the client went away before sending the whole body"
"""What a route answers when reading the body raises ClientDisconnect: its client is gone, or BodyLimit refused the
body (and answered the 413 itself); nobody reads this answer."""


class BodyLimit:
    """ASGI middleware, the one body limit of every server of ours (the store's, the LLM proxy's, the inference
    server's): a request whose body passes `max_bytes` gets `refusal(message)` (an ASGI app answering 413 in the
    server's own error shape; the message names `setting`, what raises the limit) by its declared length before any
    of it is read, or, for a chunked body, as soon as the bytes read pass the limit; the app then sees the client
    gone (Starlette's ClientDisconnect), and its answer goes nowhere. So no route of the app ever holds more than
    `max_bytes` of a request, whatever parses it (FastAPI's body models included); the rest of a refused body is
    read and dropped by uvicorn as it comes, never kept."""

    def __init__(self, app: Any, max_bytes: int, refusal: Callable[[str], Any], setting: str) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusal = refusal
        self.setting = setting

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"")
        if declared.isdigit():
            if int(declared) > self.max_bytes:
                message = too_large(int(declared), self.max_bytes, declared=True, setting=self.setting)
                await self.refusal(message)(scope, receive, send)
            else:  # the server reads no more than the declared length: nothing to count (a rollout's every call)
                await self.app(scope, receive, send)
            return
        read = 0
        refused = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal read, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_bytes:
                    refused = True
                    text = too_large(read, self.max_bytes, declared=False, setting=self.setting)
                    await self.refusal(text)(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise  # after a refusal the app fails on the missing body: nothing to report


HotHandler = Callable[[Any, "re.Match[str]"], Awaitable[Any]]
"""A hot route's handler: (Starlette Request, the path's match) -> a Starlette Response."""


class HotRoutes:
    """ASGI middleware: a POST to one of the few routes every rollout calls (`routes`: a path pattern and its
    handler) is answered by its handler directly, past FastAPI's routing, its dependency solving and its encoding of
    the answer; any other request goes on to `app`, FastAPI's routes included (they stay there, for `/docs`). An
    exception of a type in `errors` becomes that type's response (what the app's exception handler for it answers);
    any other reaches the server's error middleware, as one from a route does. Measured with the same handler behind
    uvicorn: 0.14-0.17 ms of the server's CPU a request through FastAPI, 0.06 direct (docs/benchmarks.md, "The rollout
    path's CPU"). Added first, so that the body limit and the bearer token guard these routes as every other."""

    def __init__(
        self,
        app: Any,
        routes: Sequence[tuple[re.Pattern[str], HotHandler]],
        errors: dict[type[Exception], Callable[[Any], Any]],
    ) -> None:
        self.app = app
        self.routes = list(routes)
        self.errors = errors
        self._handled = tuple(errors)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        found = self.route(scope)
        if found is None:
            await self.app(scope, receive, send)
            return
        response = await self.answer(found, scope, receive, send)
        await response(scope, receive, send)

    def route(self, scope: dict[str, Any]) -> tuple[HotHandler, re.Match[str]] | None:
        """The hot route's handler and the path's match for a request, or None (the app's to answer)."""
        if scope["type"] == "http" and scope["method"] == "POST":
            for pattern, handler in self.routes:
                match = pattern.fullmatch(scope["path"])
                if match is not None:
                    return handler, match
        return None

    async def answer(
        self, found: tuple[HotHandler, re.Match[str]], scope: dict[str, Any], receive: Any, send: Any = None
    ) -> Any:
        """The route's response to the request (an error of a type in `errors` answered as that type's)."""
        from starlette.requests import Request

        handler, match = found
        try:
            return await handler(Request(scope, receive) if send is None else Request(scope, receive, send), match)
        except self._handled as exc:
            return next(answer for kind, answer in self.errors.items() if isinstance(exc, kind))(exc)


def ours_outermost(app: Any) -> Any:
    """Our middlewares (`app.add_middleware`: plain ASGI, the bearer token, the body limit, the hot routes) run
    before FastAPI's own (its error and telemetry middlewares), not inside them: a hot route's call then passes
    through none of FastAPI's layers, which cost as much as the route's own handling on the inference server
    (issue 39's profile: 21% of its interpreter time above HotRoutes). What our layers raise reaches uvicorn, which
    logs it and answers 500 as FastAPI's error middleware does; other routes keep FastAPI's whole stack. Returns
    `app`."""
    build = app.build_middleware_stack

    def build_ours_outermost() -> Any:
        ours, app.user_middleware = app.user_middleware, []
        try:
            stack = build()
        finally:
            app.user_middleware = ours
        for cls, args, kwargs in reversed(ours):
            stack = cls(stack, *args, **kwargs)
        return stack

    app.build_middleware_stack = build_ours_outermost
    return app


def past_guards(app: Any) -> Any:
    """`app` as a caller of its own process reaches it: past our bearer token and body limit (`ours_outermost`'s
    guards: the caller is this process, which sends the token anyway, and a body it made), into the layers below them
    (the hot routes, then FastAPI's own). The LLM proxy's calls to the inference server of its process go this way:
    two layers fewer on a call, each passed again whenever the call resumes. A plain ASGI app is returned as it is."""
    if not hasattr(app, "build_middleware_stack"):
        return app
    if app.middleware_stack is None:  # as Starlette builds it on its first call
        app.middleware_stack = app.build_middleware_stack()
    inner = app.middleware_stack
    while isinstance(inner, BearerAuth | BodyLimit):
        inner = inner.app
    if inner is app.middleware_stack and not isinstance(inner, HotRoutes):
        return app
    return _PastGuards(app, inner)


class _PastGuards:
    """`past_guards`' entry: an ASGI app, and the app's hot routes where they are the first layer inside (`route`,
    `answer`: a caller of this process awaits a hot route's handler itself, `lightning.proxy.local`)."""

    def __init__(self, app: Any, inner: Any) -> None:
        self.app, self.inner = app, inner
        self.hot: HotRoutes | None = inner if isinstance(inner, HotRoutes) else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["app"] = self.app  # what Starlette's own call sets, for the routes below
        await self.inner(scope, receive, send)

    def route(self, scope: dict[str, Any]) -> tuple[HotHandler, re.Match[str]] | None:
        return self.hot.route(scope) if self.hot is not None else None

    async def answer(self, found: tuple[HotHandler, re.Match[str]], scope: dict[str, Any], receive: Any) -> Any:
        assert self.hot is not None
        scope["app"] = self.app
        return await self.hot.answer(found, scope, receive)


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
