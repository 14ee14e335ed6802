"""Emitters: reward, message, object, exception and operation spans, recorded in the active trace context."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import math
import numbers
import re
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

import pydantic
from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.trace import Status, StatusCode

from lightning import semconv
from lightning.tracing.tracer import current_scope
from lightning.types import TraceStatus

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

REDACTED = "[redacted]"
# A name is secret when, squashed to lowercase letters and digits, it ends with one of these:
# api_key, openai_api_key, hf_token, client_secret, db_password... but not max_tokens or token_ids.
_SECRET_SUFFIXES = (
    "apikey",
    "accesskey",
    "privatekey",
    "secretkey",
    "secret",
    "password",
    "passwd",
    "passphrase",
    "token",
    "credential",
    "credentials",
    "authorization",
    "bearer",
    "cookie",
)
_MAX_DEPTH = 32
_RESERVED_REWARD_NAMES = {
    semconv.REWARD_VALUE.removeprefix(semconv.REWARD_PREFIX),
    semconv.REWARD_PRIMARY_KEY.removeprefix(semconv.REWARD_PREFIX),
}
_warned_outside_context: set[str] = set()


# --- the active trace context ----------------------------------------------------------------


def _active_tracer(emitter: str) -> trace_api.Tracer | None:
    scope = current_scope()
    if scope is not None:
        return scope.otel_tracer
    if emitter not in _warned_outside_context:
        _warned_outside_context.add(emitter)
        logger.warning("%s was called outside a trace context: nothing is recorded (warned once)", emitter)
    return None


class SpanCoreFields(pydantic.BaseModel):
    """What an emitter recorded (agent-lightning's return value of the same name): the span's name, attributes,
    times and status. An agent may return a list of these from a rollout (e.g. made with `propagate=False`)."""

    name: str
    attributes: dict[str, Any]
    start_time: float
    end_time: float
    status: TraceStatus = pydantic.Field(default_factory=lambda: TraceStatus(status_code="OK"))


def _record(emitter: str, span_name: str, attributes: dict[str, Any], propagate: bool = True) -> SpanCoreFields:
    """Record a span in the active trace context (propagate=False: only describe it)."""
    now = time.time()
    if propagate:
        scope = current_scope()
        if scope is None or scope.tracer is None or not scope.tracer.record_instant(scope, span_name, attributes):
            tracer = _active_tracer(emitter)  # None outside a trace context (warned once)
            if tracer is not None:
                tracer.start_span(span_name, attributes=attributes).end()
    return SpanCoreFields(name=span_name, attributes=attributes, start_time=now, end_time=now)


def _extra_attributes(emitter: str, attributes: Mapping[str, Any] | None, reserved: str) -> dict[str, Any]:
    """agent-lightning's `attributes=`: extra span attributes, nested mappings flattened with dots."""
    if attributes is None:
        return {}
    if not isinstance(attributes, Mapping):
        raise TypeError(f"{emitter}: attributes must be a dict of span attributes, got {type(attributes).__name__}")
    flat: dict[str, Any] = {}
    _flatten(emitter, attributes, "", flat)
    clashing = sorted(key for key in flat if key.startswith(reserved))
    if clashing:
        raise ValueError(f"{emitter}: attributes {clashing} are reserved ({reserved}*); rename them")
    return flat


def _flatten(emitter: str, attributes: Mapping[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for key, value in attributes.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{emitter}: attribute names must be non-empty strings, got {key!r}")
        name = prefix + key
        if isinstance(value, Mapping):
            _flatten(emitter, value, name + ".", into)
        elif isinstance(value, str | bool | int | float):
            into[name] = value
        elif isinstance(value, list | tuple) and all(isinstance(item, str | bool | int | float) for item in value):
            into[name] = list(value)
        elif isinstance(value, list | tuple) and value and all(isinstance(item, Mapping) for item in value):
            for index, item in enumerate(value):  # agl's flattening: a list of dicts by index (rewards' dimensions)
                _flatten(emitter, item, f"{name}.{index}.", into)
        else:
            raise TypeError(
                f"{emitter}: attribute {name!r} is a {type(value).__name__}; give str, bool, int, float, a list of "
                "those, or a dict of them (or record it with emit_object)"
            )


# --- rewards ---------------------------------------------------------------------------------


def emit_reward(
    reward: float | Mapping[str, float],
    primary_key: str | None = None,
    *,
    attributes: Mapping[str, Any] | None = None,
    propagate: bool = True,
) -> SpanCoreFields:
    """Record a reward span. A number (bools count as 1.0 / 0.0) is the reward; a dict holds named rewards, of
    which `primary_key` (needed when there are several) is the one training reads. `attributes`: extra span
    attributes. propagate=False: record nothing, only return the span (an agent may return it in a list)."""
    fields = _reward_attributes(reward, primary_key)
    fields.update(_extra_attributes("emit_reward", attributes, semconv.REWARD_PREFIX))
    return _record("emit_reward", semconv.REWARD_SPAN, fields, propagate)


def reward(fn: F) -> F:
    """agent-lightning's `@reward` (deprecated there for `emit_reward`): the decorated function, sync or async, works
    as before, and each number it returns is also emitted as a reward (`emit_reward`). A result that is not a number
    (None, text) is returned and not emitted, with a warning, as agl does."""

    def emit(result: Any) -> Any:
        if isinstance(result, numbers.Real):
            emit_reward(float(result))
        else:
            logger.warning("@reward: %s returned %r, not a number; no reward emitted", fn.__qualname__, result)
        return result

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def emitting_async(*args: Any, **kwargs: Any) -> Any:
            return emit(await fn(*args, **kwargs))

        return emitting_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def emitting(*args: Any, **kwargs: Any) -> Any:
        return emit(fn(*args, **kwargs))

    return emitting  # type: ignore[return-value]


def _reward_attributes(value: float | Mapping[str, float], primary_key: str | None = None) -> dict[str, Any]:
    """The attributes of a reward span, after checking every value is a finite number: ours, and agent-lightning
    0.3's list of dimensions (primary first), so its `find_final_reward` reads our rewards too."""
    if isinstance(value, Mapping):
        attributes = _reward_component_attributes(value, primary_key)
        primary = attributes[semconv.REWARD_PRIMARY_KEY]
        dimensions = [(primary, attributes[semconv.REWARD_VALUE])]
        dimensions += [(name, float(v)) for name, v in value.items() if name != primary]
    else:
        if primary_key is not None:
            raise ValueError(
                "emit_reward: primary_key picks a component of a dict of rewards; a single reward has none"
            )
        attributes = {semconv.REWARD_VALUE: _finite_reward(value, "the reward")}
        dimensions = [("primary", attributes[semconv.REWARD_VALUE])]
    for index, (name, reward) in enumerate(dimensions):
        attributes[f"{semconv.PEER_REWARD_SPAN}.{index}.name"] = name
        attributes[f"{semconv.PEER_REWARD_SPAN}.{index}.value"] = reward
    return attributes


def _reward_component_attributes(rewards: Mapping[str, float], primary_key: str | None) -> dict[str, Any]:
    if not rewards:
        raise ValueError("emit_reward: the dict of rewards is empty")
    components: dict[str, float] = {}
    for name, value in rewards.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"emit_reward: reward names must be non-empty strings, got {name!r}")
        if name in _RESERVED_REWARD_NAMES:
            raise ValueError(f"emit_reward: {name!r} cannot name a reward: {semconv.REWARD_PREFIX}{name} is reserved")
        components[name] = _finite_reward(value, f"reward {name!r}")
    if primary_key is None:
        if len(components) > 1:
            raise ValueError(
                f"emit_reward: a dict of several rewards {sorted(components)} needs primary_key= to say which "
                "one is the reward"
            )
        primary_key = next(iter(components))
    elif primary_key not in components:
        raise ValueError(f"emit_reward: primary_key {primary_key!r} is not one of the rewards {sorted(components)}")
    attributes: dict[str, Any] = {semconv.REWARD_PREFIX + name: value for name, value in components.items()}
    attributes[semconv.REWARD_PRIMARY_KEY] = primary_key
    attributes[semconv.REWARD_VALUE] = components[primary_key]
    return attributes


def _finite_reward(value: object, what: str) -> float:
    # As in agent-lightning, a bool is a reward of 1.0 or 0.0.
    if not isinstance(value, numbers.Real):
        raise TypeError(f"emit_reward: {what} must be a finite float (or a bool), got {type(value).__name__} {value!r}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"emit_reward: {what} must be a finite float, got {reward}")
    if abs(reward) > semconv.REWARD_LIMIT:
        raise ValueError(
            f"emit_reward: {what} {reward:g} is past +-{semconv.REWARD_LIMIT:g}; scale the agent's rewards down "
            "(GRPO's advantages are relative within a group: dividing every reward by one number changes nothing)"
        )
    return reward


# --- messages, objects, exceptions -----------------------------------------------------------


def emit_message(
    message: str, attributes: Mapping[str, Any] | None = None, *, propagate: bool = True, **more: Any
) -> SpanCoreFields:
    """Record a message span: the text, plus OpenTelemetry attributes given as `attributes={...}`
    (agent-lightning's form) or as keywords. propagate=False: record nothing, only return the span."""
    if not isinstance(message, str):
        raise TypeError(f"emit_message: message must be a str, got {type(message).__name__}")
    fields = {**_extra_attributes("emit_message", attributes, semconv.MESSAGE_BODY), **more}
    return _record("emit_message", semconv.MESSAGE_SPAN, {**fields, semconv.MESSAGE_BODY: message}, propagate)


def emit_object(obj: Any, attributes: Mapping[str, Any] | None = None, *, propagate: bool = True) -> SpanCoreFields:
    """Record an object span holding `obj` as JSON (dicts, lists, str, numbers, bools, None, pydantic models),
    plus extra span `attributes`. Keys named like secrets are redacted. propagate=False: only return the span."""
    try:
        encoded = json.dumps(_plain(obj, strict=True), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"emit_object: {type(obj).__name__} cannot be recorded as JSON: {exc}") from exc
    fields = _extra_attributes("emit_object", attributes, semconv.OBJECT_JSON)
    return _record("emit_object", semconv.OBJECT_SPAN, {**fields, semconv.OBJECT_JSON: encoded}, propagate)


def emit_annotation(annotation: Mapping[str, Any], propagate: bool = True) -> SpanCoreFields:
    """agent-lightning's annotation span: `annotation`'s keys and values as the span's attributes (nested dicts
    flattened with dots, lists of dicts by index: `{"agentlightning.reward": [{"name": "x", "value": 1.0}]}` is agl's
    reward, which our readers take too). propagate=False: record nothing, only return the span."""
    if not isinstance(annotation, Mapping):
        raise TypeError(f"emit_annotation: annotation must be a dict, got {type(annotation).__name__}")
    fields = _extra_attributes("emit_annotation", annotation, semconv.ANNOTATION_SPAN + ".")
    return _record("emit_annotation", semconv.ANNOTATION_SPAN, fields, propagate)


def emit_exception(exc: BaseException) -> None:
    """Record an exception span: an OpenTelemetry exception event (type, message, stack trace), status ERROR."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"emit_exception: expected an exception, got {type(exc).__name__}")
    tracer = _active_tracer("emit_exception")
    if tracer is None:
        return
    span = tracer.start_span(semconv.EXCEPTION_SPAN)
    _mark_failed(span, exc)
    span.end()


def _mark_failed(span: trace_api.Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


# --- operations ------------------------------------------------------------------------------


class Operation:
    """A span around a block (`with operation("lookup") as op:`) or around each call of a decorated function:
    the operation's name, its inputs and output as JSON (secrets redacted), and any exception it raises."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._span: trace_api.Span | None = None
        self._token: object | None = None

    def __enter__(self) -> Operation:
        if self.name is None:
            raise ValueError('operation needs a name when used as a context manager: with operation("lookup")')
        if self._span is not None:
            raise RuntimeError(f"operation {self.name!r} is already open")
        tracer = _active_tracer("operation")
        if tracer is not None:
            self._span = tracer.start_span(semconv.OPERATION_SPAN, attributes={semconv.OPERATION_NAME: self.name})
            self._token = otel_context.attach(trace_api.set_span_in_context(self._span))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        otel_context.detach(self._token)  # type: ignore[arg-type]
        if exc is not None:
            _mark_failed(span, exc)
        span.end()

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        """Record the operation's inputs: positional ones under "args", keyword ones by name."""
        if self._span is not None:
            inputs = {"args": list(args), **kwargs} if args else kwargs
            self._span.set_attribute(semconv.OPERATION_INPUT, _lenient_json(inputs))

    def set_output(self, output: Any) -> None:
        if self._span is not None:
            self._span.set_attribute(semconv.OPERATION_OUTPUT, _lenient_json(output))

    def __call__(self, fn: F) -> F:
        name = self.name or fn.__qualname__
        signature = _signature(fn)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def traced_coroutine(*args: Any, **kwargs: Any) -> Any:
                with Operation(name) as op:
                    op._record_call(signature, args, kwargs)
                    output = await fn(*args, **kwargs)
                    op.set_output(output)
                    return output

            return traced_coroutine  # type: ignore[return-value]

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with Operation(name) as op:
                op._record_call(signature, args, kwargs)
                output = fn(*args, **kwargs)
                op.set_output(output)
                return output

        return traced  # type: ignore[return-value]

    def _record_call(self, signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._span is not None:
            self._span.set_attribute(semconv.OPERATION_INPUT, _lenient_json(_call_inputs(signature, args, kwargs)))


@overload
def operation(target: F) -> F: ...


@overload
def operation(target: str | None = None) -> Operation: ...


def operation(target: Callable[..., Any] | str | None = None) -> Any:
    """`@operation`, `@operation("name")` on sync or async functions, or `with operation("name") as op:`."""
    if callable(target):
        return Operation()(target)
    return Operation(target)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none
        return None


def _call_inputs(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (`self` and `cls` left out: their repr is noise)."""
    if signature is None:
        return {"args": list(args), **kwargs}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the call itself fails and says why
        return {"args": list(args), **kwargs}
    inputs = dict(bound.arguments)
    first = next(iter(signature.parameters), None)
    if first in ("self", "cls"):
        inputs.pop(first, None)
    return inputs


# --- JSON with secrets redacted --------------------------------------------------------------


def is_secret_name(name: str) -> bool:
    """Whether a parameter or key named `name` likely holds a credential."""
    return re.sub(r"[^a-z0-9]", "", name.lower()).endswith(_SECRET_SUFFIXES)


def _lenient_json(value: Any) -> str:
    # Tracing must never break the agent: what JSON cannot hold is recorded as its repr.
    return json.dumps(_plain(value, strict=False))


def _plain(value: Any, *, strict: bool, depth: int = 0) -> Any:
    """`value` as JSON-ready data, with the values of secret-named keys replaced by REDACTED.
    strict: raise TypeError on what JSON cannot hold instead of using its repr."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if depth >= _MAX_DEPTH:
        if strict:
            raise TypeError(f"nested deeper than {_MAX_DEPTH} levels (a cycle?)")
        return repr(value)
    if isinstance(value, pydantic.BaseModel):
        return _plain(value.model_dump(mode="json"), strict=strict, depth=depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value), strict=strict, depth=depth + 1)
    if isinstance(value, Mapping):
        return {
            _plain_key(key, strict): REDACTED
            if isinstance(key, str) and is_secret_name(key)
            else _plain(item, strict=strict, depth=depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(item, strict=strict, depth=depth + 1) for item in value]
    if strict:
        raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
    return repr(value)


def _plain_key(key: Any, strict: bool) -> Any:
    if key is None or isinstance(key, str | bool | int | float):
        return key
    if strict:
        raise TypeError(f"dict key {key!r} ({type(key).__name__}) is not JSON-serialisable")
    return repr(key)
