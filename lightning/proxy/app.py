"""The LLM proxy: an OpenAI-compatible app that forwards agents' calls to the inference servers
unchanged, asks them for the exact token ids, and stores one span per call under the call's
rollout and attempt.

Routes: `/rollout/{rollout_id}/attempt/{attempt_id}[/signed/{signature}]/v1/...` (what a runner hands its
agent; signed with the proxy's token, the route's attempt is not looked up in the store) and plain `/v1/...`
(spans only when the `x-rollout-id` / `x-attempt-id` headers name an attempt).
Admin: `POST /admin/pause`, `POST /admin/resume` (`{"weight_version": ..., "adapter": ...}`), `GET /admin/status`,
`PUT /admin/backends`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from lightning import fastjson, semconv
from lightning.credentials import redact
from lightning.proxy.capture import Call, SseReader
from lightning.proxy.continuation import Continuation, Conversations
from lightning.proxy.external import ExternalModel, complete, make_router
from lightning.proxy.writer import SpanWriter
from lightning.seeding import turn_seed
from lightning.serving import (
    DEFAULT_MAX_BODY_BYTES,
    BearerAuth,
    BodyLimit,
    HotRoutes,
    ThreadedServer,
    is_loopback,
    ours_outermost,
    past_guards,
    without_fastapi_telemetry,
)
from lightning.store.base import LightningStore
from lightning.types import (
    LLM,
    POLICY_MODEL_NAME,
    OtelResource,
    ProxyLLM,
    Span,
    SpanContext,
    TraceStatus,
    route_signature,
)

logger = logging.getLogger(__name__)

# The OpenAI routes whose calls become spans, and the GenAI operation name of each.
CAPTURED = {"chat/completions": "chat", "completions": "text_completion"}
# Failures before the backend answered: safe to send the call to another backend.
_RETRYABLE = (aiohttp.ClientConnectionError, TimeoutError)
_STICKY_ROLLOUTS = 100_000
_DOWN_SECONDS = 5.0
IDLE_CONNECTION_SECONDS = 240.0
"""Idle backend connections kept across the pause between rollout phases; below the run's servers' 300 s."""
"""A backend that refused a connection goes to the end of every call's order for this long (one restarting for a
minute then costs each call nothing, and the log one line per window instead of one per call)."""
_KNOWN_ATTEMPTS = 100_000
BODY_SETTING = "inference.max_request_mb of the run's config (--max-body-mb of `lightning proxy serve`)"
"""What sets the largest request body the proxy takes (413 beyond), named in its 413s."""


class _Unchanged:
    """`LLMProxy.resume`'s default for `adapter`: leave the adapter as it is (None there means the base model)."""


UNCHANGED = _Unchanged()


class Backend(BaseModel):
    """An inference server the proxy forwards to (vLLM or the embedded server)."""

    url: str
    """Its OpenAI base URL, e.g. http://127.0.0.1:8000/v1."""
    api_key: str | None = Field(default=None, repr=False)
    token_ids: bool = True
    """The server takes vLLM's `return_token_ids`; the proxy then always asks for token ids."""
    model: str | None = None
    """If set, the `model` of every forwarded request is rewritten to this served model name. If not, a call for the
    proxy's `model_name` is sent under the name this server lists on `GET /models` (asked once)."""
    provider: str = "vllm"
    """`gen_ai.provider.name` on the spans."""
    tool_call_format: Literal["hermes"] | None = "hermes"
    """How the model writes tool calls, for the proxy to read them where it makes a completion a chat answer (a
    multi-turn call continued on a backend without a token-in chat route): `hermes`, `<tool_call>{...}</tool_call>`
    blocks (Qwen's, Hermes', the tiny model's). None: another form; such calls then go as plain chat and their
    trajectory rows split."""


class ProxyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape, which the OpenAI SDKs turn into their typed exceptions."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(status, "APIError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


_SIGNED_ROUTE = re.compile(r"^/rollout/([^/]+)/attempt/([^/]+)/signed/([^/]+)/v1/")


class LLMProxy:
    """Forwards OpenAI-style calls to `backends`, stores a span per call in `store`.

    - `model_name`: what agents are told to ask for (`as_resource`) and what `/v1/models` lists; a
      call for it goes to each backend under that backend's own name: `Backend.model` when set,
      else the first name the backend's `GET /models` lists when it does not list `model_name`.
    - `external_models`: names answered through LiteLLM instead of the backends.
    - `token`: bearer token every request must carry (the agents' `api_key`); required to listen
      beyond loopback. It also signs the routes runners hand their agents.
    - `agents_need_token`: False lets model calls on the routes runners hand their agents (signed with the token,
      `ProxyLLM.get_base_url`) in with any key or none, as agent-lightning's proxy does: agents written for it send
      a placeholder ("dummy", their own OPENAI_API_KEY). Every other call (plain `/v1/...`, an unsigned or
      wrongly signed route, the admin routes) still needs the token, so no other process of the machine can call
      the models or write spans into a run's attempts. Only for a proxy on loopback (`start` refuses it elsewhere).
    - `max_tries`: backends tried per call; connection errors and 5xx move on to the next one
      after `retry_backoff` seconds (doubling).
    - `tokenizer`: the policy's tokenizer (or its model directory). With it, a chat call that continues an earlier
      call of its attempt is sent as that call's prompt and response ids plus the new messages' ids
      (`lightning.chat`), on the backend's `chat/completions/tokens` route, so a multi-turn trajectory is one
      token-exact row. Without it the backend renders every call's messages itself.
    - `max_body_bytes`: a request body over it is answered 413 before it is read whole, never forwarded.
    - `in_process`: backend URL -> the ASGI app that serves it in this process (the embedded inference server's, when
      one process serves both): calls to that backend go to the app directly, without HTTP (`lightning.proxy.local`).

    `weight_version` (the checkpoint step served) and `adapter` are set by `resume`, and recorded on the span of every
    call let through from then on. `adapter`: the name under which the backends serve the policy's LoRA adapter (a
    LoRA run on vLLM loads each checkpoint's adapter under a name of its own: `lightning.inference.vllm.
    publish_lora_adapter`); a call for `model_name` is sent under that name, whatever its backend serves the base as.
    """

    def __init__(
        self,
        store: LightningStore,
        backends: Sequence[Backend | str] = (),
        *,
        model_name: str = POLICY_MODEL_NAME,
        external_models: Sequence[ExternalModel] = (),
        token: str | None = None,
        agents_need_token: bool = True,
        max_tries: int = 3,
        retry_backoff: float = 0.05,
        timeout: float = 600.0,
        max_connections: int = 512,
        tokenizer: Any = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        in_process: Mapping[str, Any] | None = None,
    ) -> None:
        from lightning.proxy.local import InProcessSession

        self.store = store
        self.backends = [b if isinstance(b, Backend) else Backend(url=b) for b in backends]
        self.model_name = model_name
        self.external_models = {m.model_name: m for m in external_models}
        self.token = token
        self.agents_need_token = agents_need_token
        self.max_tries = max_tries
        self.retry_backoff = retry_backoff
        self.timeout = timeout
        self.max_connections = max_connections
        self.max_body_bytes = max_body_bytes
        self.weight_version: str | int | None = None
        self.adapter: str | None = None
        self.writer = SpanWriter(store)
        self.conversations = Conversations(tokenizer) if tokenizer is not None else None
        self._token_route = True
        """False once a backend had no `chat/completions/tokens` route: continuations then go as completions calls."""
        self.calls = 0
        self.retries = 0
        self._in_flight = 0
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._known_attempts: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._turns: OrderedDict[str, int] = OrderedDict()
        """Calls so far per attempt (most recent last), for the per-turn sampling seed."""
        self._next_backend = 0
        self._down_until: dict[int, float] = {}
        self._served: dict[str, str | None] = {}
        """Per backend URL: the model it serves when it does not list `model_name` (None: it does, or unknown)."""
        self._client: aiohttp.ClientSession | None = None
        self._local = {
            url.rstrip("/"): InProcessSession(past_guards(app), timeout) for url, app in (in_process or {}).items()
        }
        self._open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._router: Any = None
        self._background: set[asyncio.Task[None]] = set()
        self._server: Any = None
        self.url: str | None = None
        self.app = self._build_app()

    # --- Resources handed to agents ------------------------------------------------------------

    def resource(self) -> ProxyLLM:
        """The `ProxyLLM` to put in the store's resources; runners route it to each attempt."""
        if self.url is None:
            raise RuntimeError("the proxy is not serving yet: call start() first (or set proxy.url)")
        return ProxyLLM(endpoint=f"{self.url}/v1", model=self.model_name, api_key=self.token)

    def as_resource(self, rollout_id: str, attempt_id: str) -> LLM:
        """The `LLM` an agent uses for this attempt: its calls land under the attempt's spans."""
        return self.resource().with_attempted_rollout_ids(rollout_id, attempt_id)

    # --- Pause and resume around weight updates ------------------------------------------------

    async def pause(self, timeout: float | None = None) -> int:
        """Hold new calls and wait until the calls in flight have finished (streams included).
        Returns how many were drained; raises TimeoutError if they outlast `timeout`."""
        self._events()
        assert self._open is not None and self._idle is not None
        self._open.clear()
        draining = self._in_flight
        await asyncio.wait_for(self._idle.wait(), timeout)
        return draining

    async def resume(
        self, weight_version: str | int | None = None, adapter: str | None | _Unchanged = UNCHANGED
    ) -> None:
        """Let calls through again; `weight_version` is recorded on every span from now on. `adapter` (a name, or None
        for the base model; by default unchanged): what calls for `model_name` are sent as, recorded on their spans."""
        self._events()
        assert self._open is not None
        if weight_version is not None:
            self.weight_version = weight_version
        if not isinstance(adapter, _Unchanged):
            self.adapter = adapter
        self._open.set()

    def set_backends(self, backends: Sequence[Backend | str]) -> None:
        """Replace the backends (e.g. vLLM servers started or restarted); rollouts re-stick."""
        self.backends = [b if isinstance(b, Backend) else Backend(url=b) for b in backends]
        self._sticky.clear()
        self._served.clear()

    def status(self) -> dict[str, Any]:
        return {
            "paused": self._open is not None and not self._open.is_set(),
            "in_flight": self._in_flight,
            "backends": [b.url for b in self.backends],
            "external_models": sorted(self.external_models),
            "weight_version": self.weight_version,
            "adapter": self.adapter,
            "calls": self.calls,
            "retries": self.retries,
            **self.writer.stats(),
        }

    # --- The app --------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="lightning LLM proxy", docs_url="/docs", redoc_url=None, **without_fastapi_telemetry())
        ours_outermost(app)
        proxy = self

        # The LLM calls, answered past FastAPI's routing (the routes below stay, for /docs), guarded as the rest.
        hot = [
            (ROUTED, lambda request, m: proxy._handle(request, m["path"], m["rollout"], m["attempt"])),
            (SIGNED, lambda request, m: proxy._handle(request, m["path"], m["rollout"], m["attempt"], m["signature"])),
            (PLAIN, lambda request, m: proxy._handle(request, m["path"], *_attempt_headers(request))),
        ]
        app.add_middleware(HotRoutes, routes=hot, errors={ProxyError: _proxy_error})
        too_large = lambda message: error_response(413, message)  # noqa: E731
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes, refusal=too_large, setting=BODY_SETTING)
        if self.token is not None:
            admit = None if self.agents_need_token else self._signed_route
            auth = {"token": self.token, "refusal": _unauthorised, "open_paths": ("/health",)}
            app.add_middleware(BearerAuth, **auth, admit=admit)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path:path}")
        async def routed(rollout_id: str, attempt_id: str, path: str, request: Request) -> Response:
            return await proxy._handle(request, path, rollout_id, attempt_id)

        @app.post("/rollout/{rollout_id}/attempt/{attempt_id}/signed/{signature}/v1/{path:path}")
        async def signed(rollout_id: str, attempt_id: str, signature: str, path: str, request: Request) -> Response:
            return await proxy._handle(request, path, rollout_id, attempt_id, signature)

        @app.post("/v1/{path:path}")
        async def plain(path: str, request: Request) -> Response:
            return await proxy._handle(request, path, *_attempt_headers(request))

        @app.get("/v1/models")
        @app.get("/rollout/{rollout_id}/attempt/{attempt_id}/v1/models")
        @app.get("/rollout/{rollout_id}/attempt/{attempt_id}/signed/{signature}/v1/models")
        async def models(
            rollout_id: str | None = None, attempt_id: str | None = None, signature: str | None = None
        ) -> dict[str, Any]:
            created = int(time.time())
            names = [proxy.model_name, *proxy.external_models]
            data = [{"id": name, "object": "model", "created": created, "owned_by": "lightning"} for name in names]
            return {"object": "list", "data": data}

        @app.post("/admin/pause")
        async def admin_pause(timeout: float | None = None) -> dict[str, Any]:
            try:
                drained = await proxy.pause(timeout)
            except TimeoutError:
                await proxy.resume()
                return error_response(409, f"calls still in flight after {timeout}s; the proxy stays open")
            return {"paused": True, "drained": drained}

        @app.post("/admin/resume")
        async def admin_resume(request: Request) -> dict[str, Any]:
            raw = await request.body()
            body = json.loads(raw) if raw.strip() else {}
            body = body if isinstance(body, dict) else {}
            adapter = body.get("adapter", UNCHANGED)
            if not isinstance(adapter, (str, type(None), _Unchanged)):
                return error_response(400, "adapter: a LoRA adapter's name, or null for the base model", "adapter")
            await proxy.resume(body.get("weight_version"), adapter)
            return {"paused": False, "weight_version": proxy.weight_version, "adapter": proxy.adapter}

        @app.get("/admin/status")
        async def admin_status() -> dict[str, Any]:
            return proxy.status()

        @app.put("/admin/backends")
        async def admin_backends(backends: list[Backend]) -> dict[str, Any]:
            proxy.set_backends(backends)
            return {"backends": [b.url for b in proxy.backends]}

        @app.exception_handler(ProxyError)
        async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
            return _proxy_error(exc)

        return app

    # --- One call --------------------------------------------------------------------------------

    async def _handle(
        self,
        request: Request,
        path: str,
        rollout_id: str | None,
        attempt_id: str | None,
        signature: str | None = None,
    ) -> Response:
        raw: bytes | None = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ProxyError(400, "the request body is not JSON; send an OpenAI request as JSON") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object")
        operation = CAPTURED.get(path)
        routed = rollout_id is not None and attempt_id is not None and operation is not None
        if routed and not self._signed_by_us(rollout_id, attempt_id, signature):  # type: ignore[arg-type]
            await self._check_attempt(rollout_id, attempt_id)  # type: ignore[arg-type]
        if routed and isinstance(body.get("seed"), int):
            body["seed"] = turn_seed(body["seed"], self._next_turn(attempt_id))  # type: ignore[arg-type]
            raw = None  # the body changed: written once, with what `_payload` adds
        model = body.get("model")
        if operation is not None and isinstance(model, str) and model in self.external_models:
            return await self._guarded(self._external(body, operation, rollout_id, attempt_id, request))
        if not self.backends:
            raise ProxyError(503, "the proxy has no backends; register inference servers with PUT /admin/backends")
        continuation = Continuation()
        conversations = self.conversations
        if routed and operation == "chat" and conversations is not None:
            attempt = (rollout_id, attempt_id)
            if conversations.may_continue(attempt):  # type: ignore[arg-type]
                await asyncio.to_thread(lambda: conversations.fits)  # the tokenizer loaded once, the loop serving on
            continuation = conversations.prompt_for(attempt, body)  # type: ignore[arg-type]
        outbound = _Outbound(raw, body, path, operation)
        return await self._guarded(self._forward(outbound, rollout_id, attempt_id, request, continuation))

    async def _guarded(self, handler: Any) -> Response:
        """Run a call while counting it in flight (a stream stays in flight until its last byte)."""
        await self._enter()
        try:
            response = await handler
        except BaseException:
            self._exit()
            raise
        if isinstance(response, StreamingResponse):
            inner = response.body_iterator

            async def counted() -> AsyncIterator[Any]:
                try:
                    async for piece in inner:
                        yield piece
                finally:
                    self._exit()

            response.body_iterator = counted()
        else:
            self._exit()
        return response

    async def _forward(
        self,
        outbound: _Outbound,
        rollout_id: str | None,
        attempt_id: str | None,
        request: Request,
        continuation: Continuation,
    ) -> Response:
        started = time.time()
        body, operation = outbound.body, outbound.operation
        # What serves this call: fixed while it is in flight (`pause` drains the calls before weights change).
        served = (self.weight_version, self.adapter if body.get("model") == self.model_name else None)
        stream = bool(body.get("stream"))
        upstream, backend, tries, as_completion = await self._send_continued(outbound, rollout_id, continuation)
        if operation is None or rollout_id is None or attempt_id is None:
            return await _pass_through(upstream, stream)  # not an LLM call of an attempt: no span
        call = Call(operation=operation, request=body, stream=stream, status_code=upstream.status)
        if continuation.continues:
            call.continuation = continuation.reason or "joined"
        context = (rollout_id, attempt_id, request.headers.get("traceparent"), backend, tries, started, served)
        if not stream or upstream.status != 200:
            content = await upstream.read()
            upstream.release()
            if as_completion and upstream.status == 200:
                content = json.dumps(completion_as_chat(json.loads(content), bool(body.get("tools")))).encode()
            _read_whole(call, content, upstream.status)
            await self._record(call, *context)
            return Response(content, status_code=upstream.status, media_type=_media_type(upstream))

        async def relay() -> AsyncIterator[bytes]:
            # Each event goes on as soon as it is whole; `[DONE]` (however the reads split it) only after the span
            # is stored, so an agent that has its answer finds the span.
            reader = SseReader()
            first_chunk_at = None
            finished = False
            try:
                async for data in upstream.content.iter_any():
                    first_chunk_at = first_chunk_at or time.time()
                    whole, events = reader.feed(data)
                    for event in events:
                        call.read_chunk(event)
                    if whole:
                        yield whole
                    if reader.done:  # the answer is complete: do not wait for the backend to end its body
                        break
                finished = True
            except (TimeoutError, aiohttp.ClientError) as exc:
                call.error = f"the backend's stream broke off: {exc!r}"
                finished = True
            finally:
                if not finished:
                    # The agent went away mid-stream (this generator is being cancelled): what the
                    # backend sent so far is still the attempt's, so store it from a task of its own.
                    call.error = "the agent stopped reading the stream"
                    self._spawn(self._close_and_record(upstream, call, context, first_chunk_at))
            await self._close_and_record(upstream, call, context, first_chunk_at, drain=reader.done)
            rest = reader.rest()
            if rest:
                yield rest

        return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")

    async def _send_continued(
        self, outbound: _Outbound, rollout_id: str | None, continuation: Continuation
    ) -> tuple[aiohttp.ClientResponse, Backend, int, bool]:
        """`_send`, with a continued chat call's token-exact prompt: on the backend's `chat/completions/tokens` route
        (the request's fields plus `tokens`, the prompt ids: the embedded server's token-in chat route), or, on a
        backend without it (404: vLLM), as a `completions` call on the same ids whose answer `_forward` makes a chat
        completion (`completion_as_chat`; not for streams, which then go as plain chat and split). The last item:
        whether the answer is a completion to convert."""
        body = outbound.body
        if continuation.prompt_ids is not None and self._token_route:
            joined = {**body, "tokens": continuation.prompt_ids}
            sent = await self._send(_Outbound.of(joined, "chat/completions/tokens", outbound.operation), rollout_id)
            if not await _route_missing(sent[0]):
                return (*sent, False)
            sent[0].release()
            self._token_route = False
            logger.info("LLM proxy: no chat/completions/tokens route; continued chat calls go as completions on ids")
        readable = not body.get("tools") or all(b.tool_call_format == "hermes" for b in self.backends)
        if continuation.prompt_ids is not None and not body.get("stream") and readable:
            completion = chat_as_completion(body, continuation.prompt_ids)
            sent = await self._send(_Outbound.of(completion, "completions", "text_completion"), rollout_id)
            return (*sent, True)
        if continuation.prompt_ids is not None:
            continuation.reason = (
                "a streamed call on an inference server without a chat/completions/tokens route"
                if readable
                else "an inference server without a chat/completions/tokens route, and tool calls in a form the proxy "
                "does not read"
            )
        return (*await self._send(outbound, rollout_id), False)

    async def _send(self, outbound: _Outbound, rollout_id: str | None) -> tuple[aiohttp.ClientResponse, Backend, int]:
        """Send to the rollout's backend; on a connection error or a 5xx, try the next one."""
        order = self._backend_order(rollout_id)
        delay = self.retry_backoff
        failure = ""
        for tries in range(1, self.max_tries + 1):
            index = order[(tries - 1) % len(order)]
            backend = self.backends[index]
            # identity: the stream is relayed byte for byte, so it must not be compressed.
            headers = {"content-type": "application/json", "accept-encoding": "identity"}
            if backend.api_key:
                headers["authorization"] = f"Bearer {backend.api_key}"
            url = f"{backend.url.rstrip('/')}/{outbound.path}"
            try:
                model = await self._backend_model(backend, outbound.body)
                client = self._client_for(backend)
                response = await client.post(url, data=_payload(outbound, backend, model), headers=headers)
            except _RETRYABLE as exc:
                failure = redact(f"{backend.url}: {type(exc).__name__}: {exc}")
                if isinstance(exc, aiohttp.ClientConnectorError):
                    self._down_until[index] = time.monotonic() + _DOWN_SECONDS
            else:
                if response.status < 500 or tries == self.max_tries:
                    if rollout_id is not None:
                        self._stick(rollout_id, index)
                    return response, backend, tries
                failure = f"{redact(backend.url)}: HTTP {response.status}"
                response.release()
            self.retries += 1
            logger.warning("LLM proxy: %s; trying the next backend in %.2fs", failure, delay)
            await asyncio.sleep(delay)
            delay *= 2
        raise ProxyError(502, f"no backend answered after {self.max_tries} tries; last: {failure}")

    async def _external(
        self, body: dict[str, Any], operation: str, rollout_id: str | None, attempt_id: str | None, request: Request
    ) -> Response:
        """A call to a provider through LiteLLM's Router: same span, no token ids."""
        started = time.time()
        stream = bool(body.get("stream"))
        call = Call(operation=operation, request=body, stream=stream)
        served = (self.weight_version, None)
        context = (rollout_id, attempt_id, request.headers.get("traceparent"), None, 1, started, served)
        status, result = await complete(self._litellm_router(), body, operation)
        call.status_code = status
        if status != 200 or not stream:
            _read_whole(call, json.dumps(result).encode(), status)
            if rollout_id and attempt_id:
                await self._record(call, *context)
            return JSONResponse(result, status_code=status)

        async def relay() -> AsyncIterator[bytes]:
            first_chunk_at = None
            async for chunk in result:
                first_chunk_at = first_chunk_at or time.time()
                call.read_chunk(chunk)
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if rollout_id and attempt_id:
                await self._record(call, *context, first_chunk_at=first_chunk_at)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def _record(
        self,
        call: Call,
        rollout_id: str | None,
        attempt_id: str | None,
        traceparent: str | None,
        backend: Backend | None,
        tries: int,
        started: float,
        served: tuple[str | int | None, str | None],
        first_chunk_at: float | None = None,
    ) -> None:
        """Store the call's span; `served`: the weight version and the LoRA adapter (or None) it was sent to."""
        if rollout_id is None or attempt_id is None:
            return
        if self.conversations is not None and call.operation == "chat":
            self.conversations.remember((rollout_id, attempt_id), call.request, call)
        ended = time.time()
        attributes = call.attributes()
        attributes[semconv.LLM_BACKEND] = backend.url if backend else "litellm"
        attributes[semconv.GEN_AI_PROVIDER] = backend.provider if backend else "litellm"
        attributes[semconv.LLM_LATENCY_MS] = round((ended - started) * 1000, 3)
        attributes[semconv.LLM_TRIES] = tries
        if first_chunk_at is not None:
            attributes[semconv.LLM_TIME_TO_FIRST_CHUNK_MS] = round((first_chunk_at - started) * 1000, 3)
        weight_version, adapter = served
        if weight_version is not None:
            attributes[semconv.LLM_WEIGHT_VERSION] = weight_version
        if adapter is not None:
            attributes[semconv.LLM_LORA_ADAPTER] = adapter
        trace_id, parent_id = _parse_traceparent(traceparent)
        span_id = os.urandom(8).hex()
        failed = call.error is not None or call.status_code != 200
        model = call.request.get("model")
        self.calls += 1
        await self.writer.write(
            Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence_id=0,  # given by the store as the writer stores it
                trace_id=trace_id,
                span_id=span_id,
                parent_id=parent_id,
                name=f"{call.operation} {model}" if isinstance(model, str) else call.operation,
                status=TraceStatus(status_code="ERROR" if failed else "OK", description=call.error),
                attributes=attributes,
                start_time=started,
                end_time=ended,
                context=SpanContext(trace_id=trace_id, span_id=span_id),
                parent=SpanContext(trace_id=trace_id, span_id=parent_id, is_remote=True) if parent_id else None,
                resource=OtelResource(attributes={"service.name": "lightning.proxy"}),
            )
        )

    async def _close_and_record(
        self,
        upstream: aiohttp.ClientResponse,
        call: Call,
        context: tuple[Any, ...],
        first_chunk_at: float | None,
        drain: bool = False,
    ) -> None:
        """Release the backend's response and store the span. With `drain` (the stream reached `[DONE]`), the end of
        the body is read in the background first, so the connection stays reusable; otherwise releasing an unfinished
        response closes its connection, which tells the backend to stop generating."""
        if drain and not upstream.content.at_eof():
            self._spawn(_drain(upstream))
        else:
            upstream.release()
        await self._record(call, *context, first_chunk_at=first_chunk_at)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held here, or the loop may drop the task half-way
        task.add_done_callback(self._background.discard)

    # --- Helpers ---------------------------------------------------------------------------------

    def _signed_route(self, path: str) -> bool:
        """`path` is a model call on a route a runner handed its agent (`/rollout/R/attempt/A/signed/S/v1/...`,
        signed with this proxy's token): the agent may send any key on it."""
        match = _SIGNED_ROUTE.match(path)
        return match is not None and self._signed_by_us(*match.groups())

    def _signed_by_us(self, rollout_id: str, attempt_id: str, signature: str | None) -> bool:
        """A route a runner made from a claimed attempt with this proxy's token (`ProxyLLM.get_base_url`): its
        attempt exists, so the store need not be asked. Any other signature only means asking."""
        if signature is None or self.token is None:
            return False
        return hmac.compare_digest(signature, route_signature(self.token, rollout_id, attempt_id))

    async def _check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        """A call for an attempt the store does not know would answer but leave no trace: refuse it."""
        key = (rollout_id, attempt_id)
        if key in self._known_attempts:
            return
        attempts = await self.store.query_attempts(rollout_id)
        if not any(a.attempt_id == attempt_id for a in attempts):
            raise ProxyError(
                404,
                f"the store has no attempt {attempt_id!r} of rollout {rollout_id!r}; use the endpoint the runner "
                "handed the agent (proxy.as_resource(rollout_id, attempt_id))",
                "attempt_id",
            )
        self._known_attempts[key] = None
        if len(self._known_attempts) > _KNOWN_ATTEMPTS:
            self._known_attempts.popitem(last=False)

    async def _backend_model(self, backend: Backend, body: dict[str, Any]) -> str | None:
        """The `model` to send `backend` instead of the request's, or None to leave it.

        A call for the advertised `model_name` goes to the LoRA adapter the backends serve the policy as (`adapter`)
        when there is one. Otherwise `Backend.model` when set; otherwise a call for `model_name` goes to a backend
        that serves another name (a server started with its own `--served-model-name`) under the first name its
        `GET /models` lists, asked once per backend. Calls naming any other model pass unchanged.
        """
        if self.adapter is not None and body.get("model") == self.model_name:
            return self.adapter
        if backend.model is not None:
            return backend.model
        if body.get("model") != self.model_name:
            return None
        if backend.url not in self._served:
            headers = {"authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
            url = f"{backend.url.rstrip('/')}/models"
            try:
                timeout = aiohttp.ClientTimeout(total=10)
                async with self._client_for(backend).get(url, headers=headers, timeout=timeout) as response:
                    if response.status >= 500:  # starting or failing: ask again on the next call
                        return None
                    listing = await response.json(content_type=None) if response.status == 200 else None
            except (ValueError, aiohttp.ClientResponseError):  # not JSON: the name stays as the agent sent it
                listing = None
            self._served[backend.url] = _other_served_model(listing, self.model_name)
        return self._served[backend.url]

    def _backend_order(self, rollout_id: str | None) -> list[int]:
        """The rollout's backend first (its prefix cache), then the others; new rollouts round-robin."""
        count = len(self.backends)
        first = self._sticky.get(rollout_id) if rollout_id is not None else None
        if first is None or first >= count:
            first = self._next_backend % count
            self._next_backend += 1
        order = [(first + k) % count for k in range(count)]
        now = time.monotonic()
        return sorted(order, key=lambda index: self._down_until.get(index, 0.0) > now)  # stable: up ones first

    def _next_turn(self, attempt_id: str) -> int:
        """How many calls of this attempt came before this one (the turn whose seed `lightning.seeding` derives)."""
        turn = self._turns.pop(attempt_id, 0)
        self._turns[attempt_id] = turn + 1
        if len(self._turns) > _KNOWN_ATTEMPTS:
            self._turns.popitem(last=False)
        return turn

    def _stick(self, rollout_id: str, index: int) -> None:
        self._sticky[rollout_id] = index
        self._sticky.move_to_end(rollout_id)
        if len(self._sticky) > _STICKY_ROLLOUTS:
            self._sticky.popitem(last=False)

    def _http(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx: about a third of httpx's CPU per call, and the proxy's CPU is its latency.
        if self._client is None:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=IDLE_CONNECTION_SECONDS),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=5.0),
                auto_decompress=False,
            )
        return self._client

    def _client_for(self, backend: Backend) -> Any:
        """The session a call to `backend` goes on: the in-process one for a backend of this process, else HTTP."""
        return self._local.get(backend.url.rstrip("/")) or self._http()

    def _litellm_router(self) -> Any:
        if self._router is None:
            self._router = make_router(list(self.external_models.values()))
        return self._router

    def _events(self) -> None:
        if self._open is None:
            self._open, self._idle = asyncio.Event(), asyncio.Event()
            self._open.set()
            self._idle.set()

    async def _enter(self) -> None:
        self._events()
        assert self._open is not None and self._idle is not None
        if not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        self._idle.clear()

    def _exit(self) -> None:
        assert self._idle is not None
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # --- Serving on a background thread -----------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a background thread; returns the proxy's URL (http://host:port)."""
        if (self.token is None or not self.agents_need_token) and not is_loopback(host):
            raise ValueError(
                f"LLMProxy(token=None or agents_need_token=False) refuses to listen on {host}: anyone who can reach it "
                "could use the models and write spans. Pass token=... (and leave agents_need_token), or listen on "
                "127.0.0.1."
            )
        self._server = ThreadedServer(self.app, host=host, port=port)
        self.url = self._server.start()
        return self.url

    def stop(self) -> None:
        """Stop serving: finish the span writes and close the HTTP client, then the server."""
        if self._server is not None:
            self._server.call(self.aclose(), timeout=30)
            self._server.stop()
            self._server = None

    def pause_sync(self, timeout: float | None = None) -> int:
        """`pause` from another thread while serving with `start()`."""
        return self._server_loop().call(self.pause(timeout))

    def resume_sync(
        self, weight_version: str | int | None = None, adapter: str | None | _Unchanged = UNCHANGED
    ) -> None:
        """`resume` from another thread while serving with `start()`."""
        self._server_loop().call(self.resume(weight_version, adapter))

    def _server_loop(self) -> Any:
        if self._server is None:
            raise RuntimeError("the proxy is not serving on a thread: call start() first")
        return self._server

    async def aclose(self) -> None:
        """Close the HTTP client and the span writer (the store stays open: it is the caller's)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.writer.close()
        for session in self._local.values():
            await session.close()
        if self._client is not None:
            await self._client.close()
            self._client = None


_ATTEMPT = r"/rollout/(?P<rollout>[^/]+)/attempt/(?P<attempt>[^/]+)"
ROUTED = re.compile(_ATTEMPT + r"/v1/(?P<path>.*)")
SIGNED = re.compile(_ATTEMPT + r"/signed/(?P<signature>[^/]+)/v1/(?P<path>.*)")
PLAIN = re.compile(r"/v1/(?P<path>.*)")
"""The POST routes of LLM calls: an attempt's (in the path, signed or not) and a plain one (the attempt in headers)."""


def _attempt_headers(request: Request) -> tuple[str | None, str | None]:
    return request.headers.get("x-rollout-id"), request.headers.get("x-attempt-id")


def _proxy_error(exc: ProxyError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


def _unauthorised() -> JSONResponse:
    return error_response(
        401,
        "missing or wrong bearer token: send 'Authorization: Bearer <token>'. An agent sends its LLM's api_key (the "
        "run's token); a run whose agents send a key of their own (agent-lightning's 'dummy') sets "
        "proxy_any_agent_key: true",
    )


def _other_served_model(listing: Any, model_name: str) -> str | None:
    """From a `GET /models` answer: None if it lists `model_name` (or lists nothing readable), else its first id."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    return None if not ids or model_name in ids else ids[0]


@dataclass(frozen=True)
class _Outbound:
    """A request for a backend: its JSON body as bytes (sent as they are when the proxy changes nothing) and parsed,
    its route (`chat/completions`, ...), and the LLM call it is (`chat`, `text_completion`; None: not one)."""

    raw: bytes | None
    """None: the body was changed, and is written when sent."""
    body: dict[str, Any]
    path: str
    operation: str | None

    @classmethod
    def of(cls, body: dict[str, Any], path: str, operation: str | None) -> _Outbound:
        return cls(fastjson.dumps(body), body, path, operation)


def _payload(outbound: _Outbound, backend: Backend, model: str | None) -> bytes:
    """The request as the agent sent it, but asking for token ids and the sampled tokens' log-probs (which the
    trainer compares with its own: the train/inference mismatch), and naming the server's model (`model`)."""
    body, operation = outbound.body, outbound.operation
    changes: dict[str, Any] = {}
    if operation is not None and backend.token_ids and body.get("return_token_ids") is not True:
        changes["return_token_ids"] = True
    asked = body.get("logprobs")  # chat: true/false; completions: a number, 0 included
    if operation is not None and backend.token_ids and (asked is None or asked is False):
        changes["logprobs"] = True if operation == "chat" else 0
    if model is not None and body.get("model") != model:
        changes["model"] = model
    if not changes and outbound.raw is not None:
        return outbound.raw
    return fastjson.dumps({**body, **changes})


_COMPLETION_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "stop", "stop_token_ids", "seed",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "user",
)  # fmt: skip


def chat_as_completion(body: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """A chat request as a `completions` request on its prompt's token ids: the sampling fields both APIs share."""
    completion = {name: body[name] for name in _COMPLETION_FIELDS if name in body}
    if body.get("max_completion_tokens") is not None:
        completion["max_tokens"] = body["max_completion_tokens"]
    return {**completion, "prompt": prompt_ids}


def completion_as_chat(completion: dict[str, Any], parse_tools: bool) -> dict[str, Any]:
    """A `completions` answer as the chat completion the agent asked for: each choice's text as the assistant's message,
    its `<tool_call>` blocks as `tool_calls` when the request had tools (the Hermes form the embedded server parses:
    `lightning.inference.tools`), the sampled tokens' log-probs in chat's shape, the token ids kept."""
    from lightning.inference.tools import split_tool_calls

    choices = []
    prompt_ids = None
    for raw in completion.get("choices") or []:
        text, finish_reason = raw.get("text") or "", raw.get("finish_reason")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse_tools:
            content, calls = split_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content if content.strip() else None}
                message["tool_calls"] = [call.model_dump() for call in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        logprobs = raw.get("logprobs") or {}
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        tokens = (logprobs.get("tokens") or [""] * len(values)) if values is not None else []
        choices.append({
            "index": raw.get("index", 0), "message": message, "finish_reason": finish_reason,
            "logprobs": {"content": [{"token": t, "logprob": v} for t, v in zip(tokens, values, strict=False)]}
            if values is not None else None,
            "token_ids": raw.get("token_ids"),
        })  # fmt: skip
        prompt_ids = prompt_ids or raw.get("prompt_token_ids")
    return {
        "id": completion.get("id"), "object": "chat.completion", "created": completion.get("created"),
        "model": completion.get("model"), "choices": choices, "usage": completion.get("usage"),
        "prompt_token_ids": prompt_ids,
    }  # fmt: skip


async def _route_missing(response: aiohttp.ClientResponse) -> bool:
    """Whether a server answered that it has no such route: a 404 with the web framework's own body (FastAPI's, as
    vLLM's and ours are), not a 404 of the route itself (an unknown model, say). The body stays readable."""
    if response.status != 404:
        return False
    try:
        return await response.json(content_type=None) == {"detail": "Not Found"}
    except ValueError:
        return False


def _read_whole(call: Call, content: bytes, status: int) -> None:
    try:
        parsed = fastjson.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = None
    if status == 200 and isinstance(parsed, dict):
        call.read_body(parsed)
        return
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    call.error = f"HTTP {status}: {message or content[:300].decode(errors='replace')}"


def _parse_traceparent(header: str | None) -> tuple[str, str | None]:
    """W3C trace context: join the agent's trace when its HTTP client sends one."""
    if header:
        parts = header.split("-")
        if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
            return parts[1], parts[2]
    return os.urandom(16).hex(), None


def _media_type(response: aiohttp.ClientResponse) -> str:
    return response.headers.get("content-type", "application/json")


async def _pass_through(upstream: aiohttp.ClientResponse, stream: bool) -> Response:
    """The backend's answer as is; a stream goes on piece by piece as it arrives, like the routed path's."""
    if not stream or upstream.status != 200:
        content = await upstream.read()
        upstream.release()
        return Response(content, status_code=upstream.status, media_type=_media_type(upstream))

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for data in upstream.content.iter_any():
                yield data
        except (TimeoutError, aiohttp.ClientError) as exc:  # headers are sent: the stream just ends early
            logger.warning("LLM proxy: the backend's stream broke off: %r", exc)
        finally:
            upstream.release()

    return StreamingResponse(relay(), status_code=200, media_type=_media_type(upstream))


async def _drain(upstream: aiohttp.ClientResponse, timeout: float = 5.0) -> None:
    """Read what a backend still sends after `[DONE]` (normally just the body's end), then release it."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in upstream.content.iter_any():
                pass
    except (TimeoutError, aiohttp.ClientError):
        pass
    finally:
        upstream.release()
