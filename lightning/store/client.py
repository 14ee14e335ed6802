"""The store protocol spoken over HTTP to `lightning store serve`, usable from any thread and event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp
import pydantic
from yarl import URL

from lightning.credentials import split_credentials
from lightning.store import contract
from lightning.store.agl_answers import AglUnknownIds
from lightning.store.base import LightningStore, LightningStoreCapabilities
from lightning.store.contract import MAX_WAIT_SECONDS, Request
from lightning.store.errors import AuthError, ConflictError, InvalidArgumentError, NotFoundError, StoreError

logger = logging.getLogger(__name__)

_ANSWERS: dict[type[Request], pydantic.TypeAdapter[Any]] = {}
"""The parser of each request type's answer, made on first use."""
_ERRORS: dict[int, type[StoreError]] = {404: NotFoundError, 409: ConflictError, 422: InvalidArgumentError}
_FIRST_BACKOFF, _MAX_BACKOFF = 0.1, 2.0
_KEEPALIVE_SECONDS = 4.0
"""How long an idle connection is kept for the next call: under uvicorn's 5 s, so that the client, not the server,
closes it, and no call goes out on a connection the server is closing."""


class HttpLightningStore(LightningStore):
    """The store at `base_url` (e.g. `http://127.0.0.1:4747`), served by `lightning store serve`.

    `token`: the server's bearer token. `timeout`: seconds per request (waits come on top).
    `retries`: further tries, with backoff, after a transport error or a 503 - only for calls that
    are safe to repeat (reads, keyed enqueues, spans, sequence ids, heartbeats); every other call
    is sent once and its failure raised, never turned into an empty answer. A refused token (401, 403)
    is an AuthError at once."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 30.0, retries: int = 3) -> None:
        if retries < 0:
            raise InvalidArgumentError(f"retries must be >= 0, got {retries}")
        # `http://:TOKEN@host` and `http://host/t/TOKEN` (agl's form) give a token too; the URL kept (and printed in
        # errors) has none.
        base_url, in_url = split_credentials(base_url)
        token = token or in_url
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._urls: dict[str, URL] = {}
        self._timeout = timeout
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {0.0: aiohttp.ClientTimeout(total=timeout)}
        self._retries = retries
        # aiohttp sessions belong to the event loop that made them: one per loop that calls us, each held open by
        # a generator that closes it when closed itself, by us or as its loop shuts down (_holder).
        self._sessions: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, AsyncGenerator[None, None]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpLightningStore({self.base_url!r})"

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        """A store server takes OTLP/HTTP traces too (`otlp_traces_endpoint()`)."""
        return LightningStoreCapabilities(thread_safe=True, async_safe=True, zero_copy=True, otlp_traces=True)

    def otlp_traces_endpoint(self) -> str:
        """The server's OTLP/HTTP traces route (spans carry the rollout and attempt ids as attributes)."""
        return f"{self.base_url}/v1/traces"

    @property
    def token(self) -> str | None:
        """The server's bearer token this client sends (given, or from its URL); never in its repr or errors."""
        return self._token

    # --- transport ---------------------------------------------------------------------------
    # aiohttp, not httpx: measured here, a call costs the client about 0.12 ms of CPU on aiohttp and 0.5 ms on
    # httpx, and over HTTP the client's CPU is a good part of a store call's latency.

    async def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise StoreError("the store client is closed")
            found = self._sessions.get(loop)
            if found is not None:
                return found[0]
            ended = [self._sessions.pop(other)[1] for other in list(self._sessions) if other.is_closed()]
            session = aiohttp.ClientSession(
                # Keep-alive connections, reused call after call.
                connector=aiohttp.TCPConnector(limit=100, keepalive_timeout=_KEEPALIVE_SECONDS),
                headers=self._headers,
                auto_decompress=False,
            )
            holder = _holder(session)
            self._sessions[loop] = (session, holder)
        await holder.asend(None)
        for old in ended:
            await old.aclose()  # its loop has ended: aiohttp just lets go of the sockets
        return session

    def _url(self, method: str) -> URL:
        url = self._urls.get(method)
        if url is None:
            url = self._urls[method] = URL(f"{self.base_url}/v1/store/{method}")
        return url

    async def _call(self, method: str, body: bytes = b"{}", *, safe: bool, wait: float = 0.0) -> bytes:
        """POST /v1/store/<method>; the response body. `safe`: the call may be repeated without harm."""
        session = await self._session()
        timeout = self._timeouts.get(wait) or aiohttp.ClientTimeout(total=self._timeout + wait)
        tries = 1 + (self._retries if safe else 0)
        problem: StoreError | None = None
        for attempt in range(tries):
            if attempt:
                delay = min(_FIRST_BACKOFF * 2 ** (attempt - 1), _MAX_BACKOFF)
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))  # spread out clients that failed together
            try:
                async with session.post(self._url(method), data=body, timeout=timeout) as response:
                    content = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = StoreError(
                    f"{method}: no answer from the store at {self.base_url}: {type(exc).__name__}: {exc}"
                )
                problem.__cause__ = exc
                continue
            if response.status == 200:
                return content
            problem = _error_from(method, response.status, response.reason, content, self.base_url)
            if response.status != 503:
                raise problem
        assert problem is not None
        if tries > 1:
            logger.warning("%s failed after %d tries: %s", method, tries, problem)
        raise problem

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            sessions, self._sessions = self._sessions, {}
        current = asyncio.get_running_loop()
        for loop, (_, holder) in sessions.items():
            if loop is current or loop.is_closed():  # on an ended loop, aiohttp just lets go of the sockets
                await holder.aclose()
            elif loop.is_running():
                closing = asyncio.run_coroutine_threadsafe(holder.aclose(), loop)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(closing), timeout=2.0)
            # A loop that has stopped but not ended cannot run close; its sockets go with the session object.

    # --- the requests ------------------------------------------------------------------------

    async def handle(self, request: Request) -> Any:
        """POST the request to `/v1/store/<method>`; the answer as the method's response type. Waits longer than
        one request may wait (MAX_WAIT_SECONDS) are several requests."""
        if request.claims:
            return await self._dequeue_in_slices(request)
        if isinstance(request, contract.WaitForRollouts):
            return await self._wait_in_slices(request)
        return await self._send(request)

    async def _send(self, request: Request, wait: float = 0.0) -> Any:
        answer = _ANSWERS.get(type(request))
        if answer is None:
            answer = _ANSWERS[type(request)] = pydantic.TypeAdapter(request.response)
        # Only the fields the caller gave (nested values whole): the server applies the same defaults, and an update
        # changes only those.
        body = request.model_dump_json(include=request.model_fields_set).encode()
        return answer.validate_json(await self._call(request.method, body, safe=request.repeatable(), wait=wait))

    async def _dequeue_in_slices(self, request: Request) -> Any:
        """Never repeated: a lost answer would leave a claimed rollout nobody runs."""
        deadline = time.monotonic() + (request.waits_for() or 0.0)
        while True:
            slice_ = min(max(deadline - time.monotonic(), 0.0), MAX_WAIT_SECONDS)
            claimed = await self._send(request.waiting(slice_), wait=slice_)
            if contract.claimed_any(claimed) or time.monotonic() >= deadline:
                return claimed

    async def _wait_in_slices(self, request: contract.WaitForRollouts) -> list[Any]:
        """A wait for rollouts (or for their ids: `WaitForFinishedIds`) in requests of at most MAX_WAIT_SECONDS."""
        wanted = list(dict.fromkeys(request.rollout_ids))
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        finished: dict[str, Any] = {}
        pending = wanted
        while True:
            remaining = MAX_WAIT_SECONDS if deadline is None else max(deadline - time.monotonic(), 0.0)
            slice_ = min(remaining, MAX_WAIT_SECONDS)
            done = await self._send(type(request)(rollout_ids=pending, timeout=slice_), wait=slice_)
            finished.update((item if isinstance(item, str) else item.rollout_id, item) for item in done)
            pending = [rid for rid in pending if rid not in finished]
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return [finished[rid] for rid in wanted if rid in finished]


# --- helpers ----------------------------------------------------------------------------------


async def _holder(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Closes `session` when closed. Started on the session's loop, it is also closed when that loop shuts down:
    asyncio.run (and uvicorn, pytest's loops) close a loop's open async generators before it ends, so a store
    nobody closed leaves no connection open behind it, nor aiohttp's "Unclosed client session" in the log."""
    try:
        yield
    finally:
        await session.close()


def _error_from(method: str, status: int, reason: str | None, content: bytes, base_url: str) -> StoreError:
    """The typed store error for an error answer, with the server's message."""
    try:
        detail = json.loads(content).get("detail")
    except (ValueError, AttributeError):
        detail = None
    if detail is None:
        detail = content[:500].decode(errors="replace") or reason or ""
    elif not isinstance(detail, str):
        detail = json.dumps(detail)
    if status in (401, 403):
        return AuthError(f"{method}: the store server at {base_url} refused the request: HTTP {status}: {detail}")
    error_type = _ERRORS.get(status, StoreError)
    if error_type is StoreError:
        detail = f"{method}: HTTP {status}: {detail}"
    return error_type(detail)


class LightningStoreClient(AglUnknownIds, HttpLightningStore):
    """agent-lightning's store client, by its name and arguments: `LightningStoreClient("http://host:4747")`, the
    address of `lightning store serve` (or of agl's own server: this client speaks our `/v1/store` routes, which
    only ours serves). `retry_delays`: its length is how many times a call safe to repeat is tried again (our client
    picks its own back-off); `request_timeout`: seconds per request. `health_retry_delays` and `connection_timeout`
    are accepted for agl's code and change nothing. `token`: the server's bearer token. Unknown rollout ids are
    answered as agl's client gets them answered: `query_spans` with an empty page, `wait_for_rollouts` by leaving
    them out (lightning.store.agl_answers)."""

    def __init__(
        self,
        server_address: str,
        *,
        retry_delays: Sequence[float] = (1.0, 2.0, 5.0),
        health_retry_delays: Sequence[float] = (0.1, 0.2, 0.5),
        request_timeout: float = 30.0,
        connection_timeout: float = 5.0,
        token: str | None = None,
    ) -> None:
        super().__init__(server_address, token=token, timeout=request_timeout, retries=len(retry_delays))
        self.server_address = self.base_url

    def __repr__(self) -> str:
        return f"LightningStoreClient({self.base_url!r})"
