"""The embedded OpenAI-compatible inference server on transformers, answering with the same token-id fields as vLLM."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning import fastjson
from lightning.chat import PromptTooLong, check_fits
from lightning.checkpoint import CheckpointError
from lightning.devices import dtype_name
from lightning.inference.engine import InferenceEngine, Output, SamplingParams, TokenLogprob
from lightning.inference.tools import ToolCall, ToolCallParser, split_tool_calls
from lightning.serving import (
    DEFAULT_MAX_BODY_BYTES,
    BearerAuth,
    BodyLimit,
    HotRoutes,
    ours_outermost,
    without_fastapi_telemetry,
)

BODY_SETTING = "inference.max_request_mb of the run's config (--max-body-mb of `lightning inference serve`)"
"""What sets the largest request body the server takes (413 beyond), named in its 413s."""


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, param: str | None = None, type: str = "BadRequestError"):
        super().__init__(message)
        self.status_code, self.message, self.param, self.type = status_code, message, param, type

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.status_code}
        return JSONResponse({"error": error}, status_code=self.status_code)


# ---- request schemas (unknown fields are accepted and ignored, as OpenAI clients send many) ----------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's field: answer with the prompt's and each choice's token ids."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """"auto" (the default) or "none"; "required" and a named function need constrained decoding: refused."""
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"}: JSON modes need constrained decoding, which this server does not do."""
    add_generation_prompt: bool = True

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class ChatCompletionWithTokensRequest(ChatCompletionRequest):
    """vLLM's token-in chat request (`POST /v1/chat/completions/tokens`): a chat request whose prompt is `tokens`, as
    given, instead of its messages rendered by the chat template; the answer is a chat completion as usual (tool
    calls parsed). The LLM proxy sends a multi-turn conversation's later calls this way (`lightning.chat`)."""

    tokens: list[int] = Field(min_length=1)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ReloadRequest(BaseModel):
    path: str
    version: int | str | None = None


# ---- the app --------------------------------------------------------------------------------------------------------


def _invalid(errors: Sequence[Any]) -> OpenAIError:
    """A request body that is not JSON or not the request's schema, as one 400 naming each field and its fault."""
    messages, params = [], []
    for error in errors:
        loc = [str(part) for part in error["loc"] if part != "body"]
        param = ".".join(loc) or "body"
        params.append(param)
        if error["type"] == "json_invalid":
            messages.append("the request body is not valid JSON")
        else:
            messages.append(f"{param}: {error['msg']}")
    return OpenAIError(400, "; ".join(messages), params[0] if params else None)


async def _body(schema: type[BaseModel], request: Request) -> Any:
    """The request's JSON body as `schema`, as FastAPI reads a body parameter (parsed, then validated)."""
    raw = await request.body()
    try:
        return schema.model_validate(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "the request body is not valid JSON", "body") from None
    except ValidationError as exc:
        raise _invalid(exc.errors()) from None


def _answer(result: Any) -> Response:
    """A route's result as the response FastAPI would make of it: a Response as it is, a dict as JSON."""
    if isinstance(result, Response):
        return result
    return Response(fastjson.dumps(result), media_type="application/json")


_REQUEST_PREFIX = secrets.token_hex(6)
_request_numbers = itertools.count()


def _request_number() -> str:
    """A completion's id, unique in this process and, by its random prefix, across servers and restarts: uuid4 (an
    os.urandom call a request) was 5% of the server's CPU on the demo's two-token calls (issue 39)."""
    return f"{_REQUEST_PREFIX}{next(_request_numbers):08x}"


def _wrong_api_key() -> JSONResponse:
    return OpenAIError(
        401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None, "AuthenticationError"
    ).response()


def _too_large(message: str) -> JSONResponse:
    return OpenAIError(413, message, None, "RequestTooLarge").response()


def create_inference_app(
    model_path: str | Path,
    *,
    served_model_name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    max_batch_size: int = 32,
    api_key: str | None = None,
    batch_invariant: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The server for the model in the Hugging Face directory `model_path`; `app.state.engine` is its engine.

    The engine thread starts with the app's lifespan, or on the first request when served with lifespan off.
    With `api_key`, every route but /health (the API docs too) needs `Authorization: Bearer <api_key>`. A request
    body over `max_body_bytes` is answered 413 before it is read whole.
    """
    engine = InferenceEngine(
        model_path, device=device, dtype=dtype, max_batch_size=max_batch_size, batch_invariant=batch_invariant
    )
    model_name = served_model_name or Path(model_path).resolve().name
    prompt_ids_of = PromptIds(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = ours_outermost(FastAPI(title="lightning inference", lifespan=lifespan, **without_fastapi_telemetry()))
    app.state.engine = engine

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(exc.errors()).response()

    # The generation routes, answered past FastAPI's routing and encoding (their routes below stay, for /docs).
    async def chat_route(request: Request, _: re.Match[str]) -> Response:
        return _answer(await chat(await _body(ChatCompletionRequest, request), None))

    async def tokens_route(request: Request, _: re.Match[str]) -> Response:
        body = await _body(ChatCompletionWithTokensRequest, request)
        return _answer(await chat(body, completion_prompt_token_ids(engine, body.tokens, "tokens")))

    async def completions_route(request: Request, _: re.Match[str]) -> Response:
        return _answer(await completions(await _body(CompletionRequest, request)))

    hot = [
        (re.compile("/v1/chat/completions"), chat_route),
        (re.compile("/v1/chat/completions/tokens"), tokens_route),
        (re.compile("/v1/completions"), completions_route),
    ]
    app.add_middleware(HotRoutes, routes=hot, errors={OpenAIError: OpenAIError.response})
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refusal=_too_large, setting=BODY_SETTING)
    if api_key is not None:
        app.add_middleware(BearerAuth, token=api_key, refusal=_wrong_api_key, open_paths=("/health",))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise OpenAIError(
                404, f"The model `{name}` does not exist; this server serves `{model_name}`.", "model", "NotFoundError"
            )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        model = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "lightning",
            "root": engine.model_path,
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [model]}

    @app.get("/admin/version")
    async def version() -> dict[str, Any]:
        """The weights served: their version and directory (a LoRA adapter's, merged into `base_model`), the whole
        weights' directory, and the device and dtype they are held in."""
        return {
            "version": engine.version, "path": engine.model_path, "base_model": engine.base_path,
            "device": str(engine.device), "dtype": dtype_name(engine.dtype),
        }  # fmt: skip

    @app.post("/admin/reload")
    async def reload(body: ReloadRequest) -> dict[str, Any]:
        if not Path(body.path).is_dir():
            raise OpenAIError(
                400, f"path: {body.path!r} is not a directory; give a Hugging Face model directory", "path"
            )
        try:
            return await engine.reload(body.path, body.version)
        except (OSError, ValueError, CheckpointError) as exc:
            raise OpenAIError(400, f"path: could not load a model from {body.path!r}: {exc}", "path") from exc

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return await chat(body, None)

    @app.post("/v1/chat/completions/tokens")
    async def chat_completions_with_tokens(body: ChatCompletionWithTokensRequest) -> Any:
        return await chat(body, completion_prompt_token_ids(engine, body.tokens, "tokens"))

    async def chat(body: ChatCompletionRequest, prompt_ids: list[int] | None) -> Any:
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        check_tool_choice(body.tool_choice)
        check_response_format(body.response_format)
        if prompt_ids is None:
            prompt_ids = prompt_ids_of(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling_params(
            engine, body, prompt_ids, max_tokens, (body.top_logprobs or 0) if body.logprobs else None
        )
        request_id = f"chatcmpl-{_request_number()}"
        outputs = engine.generate(request_id, prompt_ids, params)
        if body.stream:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(body.n)
            ]
            opening = {"choices": first, **({"prompt_token_ids": prompt_ids} if body.return_token_ids else {})}
            choice = chat_chunk_choice(engine, body)
            return streamed_response(
                body, request_id, "chat.completion.chunk", model_name, prompt_ids, outputs, choice, opening
            )
        choices = await collect(outputs, params.n)
        response = whole_response(request_id, "chat.completion", model_name, prompt_ids, choices)
        for index, choice in enumerate(choices):
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            finish_reason = choice.finish_reason
            if body.parses_tool_calls():
                content, tool_calls = split_tool_calls(choice.text)
                if tool_calls:
                    message = {
                        "role": "assistant",
                        "content": content if content.strip() else None,
                        "tool_calls": [call.model_dump() for call in tool_calls],
                    }
                    finish_reason = tool_calls_finish_reason(finish_reason)
            item: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(engine, choice.logprobs) if body.logprobs else None,
                "finish_reason": finish_reason,
            }
            if body.return_token_ids:
                item["token_ids"] = choice.token_ids
            response["choices"].append(item)
        if body.return_token_ids:  # vLLM: the chat prompt's ids at the top level
            response["prompt_token_ids"] = prompt_ids
        return response

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        check_model(body.model)
        if body.echo:
            raise OpenAIError(400, "echo: not supported by this server; leave it false", "echo")
        prompt_ids = completion_prompt_token_ids(engine, body.prompt)
        params = sampling_params(engine, body, prompt_ids, body.max_tokens, body.logprobs, default_max_tokens=16)
        request_id = f"cmpl-{_request_number()}"
        outputs = engine.generate(request_id, prompt_ids, params)
        if body.stream:
            choice = completion_chunk_choice(engine, body, prompt_ids)
            return streamed_response(body, request_id, "text_completion", model_name, prompt_ids, outputs, choice)
        choices = await collect(outputs, params.n)
        response = whole_response(request_id, "text_completion", model_name, prompt_ids, choices)
        for index, choice in enumerate(choices):
            item: dict[str, Any] = {
                "index": index,
                "text": choice.text,
                "logprobs": completion_logprobs(engine, choice.logprobs, 0) if body.logprobs is not None else None,
                "finish_reason": choice.finish_reason,
            }
            if body.return_token_ids:  # vLLM: a completion's prompt ids on each choice
                item["prompt_token_ids"] = prompt_ids
                item["token_ids"] = choice.token_ids
            response["choices"].append(item)
        return response

    return app


# ---- what the server does not do ----------------------------------------------------------------------------------


def check_tool_choice(tool_choice: str | dict[str, Any] | None) -> None:
    """ "auto" and "none" are honoured; forcing a call ("required", a named function) needs constrained decoding."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return
    forced = tool_choice if isinstance(tool_choice, str) else json.dumps(tool_choice)
    if isinstance(tool_choice, str) and tool_choice != "required":
        raise OpenAIError(400, f"tool_choice: {forced!r} is not one of 'auto', 'none', 'required'", "tool_choice")
    raise OpenAIError(
        400,
        f"tool_choice: {forced} would force a tool call, which needs constrained decoding; this server does not do "
        "it. Send 'auto' (the model may call a tool) or 'none', or use the vllm backend.",
        "tool_choice",
    )


def check_response_format(response_format: dict[str, Any] | None) -> None:
    if response_format is None or response_format.get("type") == "text":
        return
    kind = response_format.get("type")
    raise OpenAIError(
        400,
        f"response_format: {kind!r} needs constrained decoding, which this server does not do; only "
        '{"type": "text"} is supported (ask for JSON in the prompt, or use the vllm backend)',
        "response_format",
    )


def tool_calls_finish_reason(finish_reason: str | None) -> str | None:
    """OpenAI ends a turn that calls tools with "tool_calls"; a cut-off one ("length") stays what it was."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


# ---- prompts and sampling parameters --------------------------------------------------------------------------------


PROMPT_CACHE_SIZE = 4096
"""How many distinct chat prompts' token ids a server keeps (`PromptIds`)."""


class PromptIds:
    """Chat requests' prompt token ids, kept for the last `size` distinct prompts (messages, tools and
    add_generation_prompt, as JSON): GRPO samples each task's prompt several times (8 on the demo), and rendering the
    chat template (jinja) and tokenizing were 15% of the server's CPU in a profile (issue 39). The tokenizer is the
    engine's for its whole life (a reload swaps the weights alone)."""

    def __init__(self, engine: InferenceEngine, size: int = PROMPT_CACHE_SIZE) -> None:
        self.engine = engine
        self.size = size
        self._ids: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()

    def __call__(self, body: ChatCompletionRequest) -> list[int]:
        messages = chat_messages(body)
        key = fastjson.dumps([messages, body.tools, body.add_generation_prompt], default=str)
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = chat_prompt_token_ids(self.engine, body, messages)
            if len(self._ids) > self.size:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return list(ids)  # the caller's own: a response and the engine hold on to it


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them (every message with a content, None if not given)."""
    messages = [message.model_dump(exclude_unset=True) for message in body.messages]
    for message in messages:
        message.setdefault("content", None)
    return messages


def chat_prompt_token_ids(
    engine: InferenceEngine, body: ChatCompletionRequest, messages: list[dict[str, Any]] | None = None
) -> list[int]:
    """The chat template rendered on the request's messages (`chat_messages`) and tokenized."""
    messages = chat_messages(body) if messages is None else messages
    try:
        text = engine.tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # the template is user data (jinja); its errors are the request's fault
        raise OpenAIError(400, f"messages: the chat template could not render them: {exc}", "messages") from exc
    check_fits_before_tokenizing(engine, text, "messages")
    return engine.codec.encode(text)


def check_fits_before_tokenizing(engine: InferenceEngine, text: str, param: str) -> None:
    """Refuse (400) a text too long for the model's context without tokenizing the whole of it (a 5 MB prompt held
    the server for seconds and a gigabyte before its 400): `lightning.chat.check_fits`."""
    try:
        check_fits(engine.tokenizer, text, engine.context_length, engine.max_token_chars)
    except PromptTooLong as exc:
        raise OpenAIError(400, f"{param}: {exc}", param) from None


def completion_prompt_token_ids(engine: InferenceEngine, prompt: str | list[int], field: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        check_fits_before_tokenizing(engine, prompt, field)
        ids = engine.codec.encode(prompt)
    else:
        vocab_size = len(engine.tokenizer)
        bad = [token for token in prompt if not 0 <= token < vocab_size]
        if bad:
            raise OpenAIError(400, f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", field)
        ids = list(prompt)
    if not ids:
        raise OpenAIError(400, f"{field}: is empty; give at least one token", field)
    return ids


def sampling_params(
    engine: InferenceEngine,
    body: _GenerationRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """The request's sampling parameters, after checking that prompt and output fit the model's context."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    room = engine.context_length - len(prompt_ids)
    if room < 1:
        raise OpenAIError(
            400,
            f"{param}: the prompt is {len(prompt_ids)} tokens but the model's context is {engine.context_length}; "
            "shorten the prompt",
            param,
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens or room, room)
    elif max_tokens > room:
        raise OpenAIError(
            400,
            f"max_tokens: {max_tokens} new tokens after a {len(prompt_ids)}-token prompt exceed the model's context "
            f"of {engine.context_length}; ask for at most {room}",
            "max_tokens",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        n=body.n,
        seed=body.seed,
        stop=[s for s in stop if s],
        stop_token_ids=list(body.stop_token_ids or []),
        logprobs=logprobs,
    )


# ---- responses ------------------------------------------------------------------------------------------------------


class Choice:
    """One choice's outputs, concatenated."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None


async def collect(outputs: AsyncIterator[Output], n: int) -> list[Choice]:
    choices = [Choice() for _ in range(n)]
    try:
        async for output in outputs:
            choice = choices[output.index]
            choice.text += output.text
            choice.token_ids += output.token_ids
            choice.logprobs += output.logprobs
            choice.finish_reason = output.finish_reason or choice.finish_reason
    except Exception as exc:
        raise OpenAIError(500, f"generation failed: {exc}", None, "InternalServerError") from exc
    return choices


def whole_response(
    request_id: str, kind: str, model_name: str, prompt_ids: list[int], choices: list[Choice]
) -> dict[str, Any]:
    """The envelope of a non-streamed response; the caller appends its API's choices."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
        "choices": [],
        "usage": usage(len(prompt_ids), sum(len(choice.token_ids) for choice in choices)),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(engine: InferenceEngine, token_id: int) -> str:
    """The token's text, decoded once for the engine's life: each answer's logprobs spell each token, and its top
    alternatives, and decoding them was 4% of the server's event loop thread (issue 39)."""
    text = engine.token_texts.get(token_id)
    if text is None:
        text = engine.token_texts[token_id] = engine.tokenizer.decode([token_id])
    return text


def token_bytes(engine: InferenceEngine, token_id: int) -> list[int]:
    """The token's bytes; for a byte-level BPE token (GPT-2 style) these may be part of a UTF-8 character."""
    piece = engine.tokenizer.convert_ids_to_tokens(token_id)
    if piece is not None and all(char in _BYTE_OF_CHAR for char in piece):
        return [_BYTE_OF_CHAR[char] for char in piece]
    return list(token_text(engine, token_id).encode())


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte is shown as a printable character; this maps it back."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()


def chat_logprobs(engine: InferenceEngine, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(engine, token_id), "logprob": logprob, "bytes": token_bytes(engine, token_id)}

    content = [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(i, lp) for i, lp in item.top]}
        for item in logprobs
    ]
    return {"content": content}


def completion_logprobs(engine: InferenceEngine, logprobs: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    tokens = [token_text(engine, item.token_id) for item in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [{token_text(engine, i): lp for i, lp in item.top} for item in logprobs],
        "text_offset": offsets,
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def sse_error(exc: Exception) -> str:
    # Headers are gone once a stream has started; the error travels as an event, as OpenAI and vLLM do.
    return sse({"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}})


def streamed_response(
    body: _GenerationRequest,
    request_id: str,
    kind: str,
    model_name: str,
    prompt_ids: list[int],
    outputs: AsyncIterator[Output],
    choice: Callable[[Output], dict[str, Any]],
    opening: dict[str, Any] | None = None,
) -> StreamingResponse:
    """The envelope of a streamed response: an event of `opening`'s fields (if given), one per output with its
    `choice`, the usage if `stream_options` asks for it, then [DONE]."""

    async def events() -> AsyncIterator[str]:
        envelope = {"id": request_id, "object": kind, "created": int(time.time()), "model": model_name}
        if opening is not None:
            yield sse({**envelope, **opening})
        completion_tokens = 0
        try:
            async for output in outputs:
                completion_tokens += len(output.token_ids)
                yield sse({**envelope, "choices": [choice(output)]})
        except Exception as exc:
            yield sse_error(exc)
            return
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**envelope, "choices": [], "usage": usage(len(prompt_ids), completion_tokens)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def chat_chunk_choice(engine: InferenceEngine, body: ChatCompletionRequest) -> Callable[[Output], dict[str, Any]]:
    """A streamed chat completion's choice for each output, in order."""
    # With tools, each choice's text goes through a parser: a tool call goes out whole once its block is closed.
    parsers = [ToolCallParser() for _ in range(body.n)] if body.parses_tool_calls() else None
    tool_calls_sent = [0] * body.n

    def choice(output: Output) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": output.text}
        finish_reason = output.finish_reason
        if parsers is not None:
            parser = parsers[output.index]
            pieces = parser.feed(output.text) + (parser.finish() if output.finish_reason else [])
            calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
            delta = {"content": "".join(piece for piece in pieces if isinstance(piece, str))}
            if calls:
                delta["content"] = delta["content"] or None  # OpenAI: null beside tool calls
                first_index = tool_calls_sent[output.index]
                delta["tool_calls"] = [{"index": first_index + k, **call.model_dump()} for k, call in enumerate(calls)]
                tool_calls_sent[output.index] += len(calls)
            if tool_calls_sent[output.index]:
                finish_reason = tool_calls_finish_reason(finish_reason)
        chunk_choice: dict[str, Any] = {
            "index": output.index,
            "delta": delta,
            "logprobs": chat_logprobs(engine, output.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason,
        }
        if body.return_token_ids:
            chunk_choice["token_ids"] = output.token_ids
        return chunk_choice

    return choice


def completion_chunk_choice(
    engine: InferenceEngine, body: CompletionRequest, prompt_ids: list[int]
) -> Callable[[Output], dict[str, Any]]:
    """A streamed completion's choice for each output, in order."""
    text_offsets = [0] * body.n
    started: set[int] = set()

    def choice(output: Output) -> dict[str, Any]:
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(engine, output.logprobs, text_offsets[output.index])
            text_offsets[output.index] += sum(len(token) for token in logprobs["tokens"])
        chunk_choice: dict[str, Any] = {
            "index": output.index,
            "text": output.text,
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
        }
        if body.return_token_ids:
            if output.index not in started:
                chunk_choice["prompt_token_ids"] = prompt_ids
            chunk_choice["token_ids"] = output.token_ids
        started.add(output.index)
        return chunk_choice

    return choice
