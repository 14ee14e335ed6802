"""agent-lightning's adapter base classes (its `agentlightning.adapter.base`): an `Adapter` turns a source into a
target with `adapt(source)`, and calling it adapts. `TraceAdapter` adapts stored spans, `OtelTraceAdapter`
OpenTelemetry SDK spans. Our adapters are functions over spans (lightning.adapter.spans_to_triplets,
spans_to_messages); the adapters with agl's names (TraceToMessages, TracerTraceToTriplet, LlmProxyTraceToTriplet)
subclass these, so that agl code that subclasses them or checks `isinstance(x, TraceAdapter)` carries over."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from lightning.types import Span

T_from = TypeVar("T_from")
T_to = TypeVar("T_to")


class Adapter(Generic[T_from, T_to]):
    """`adapt(source)` -> target; `adapter(source)` is the same call. A subclass defines `adapt`."""

    def __call__(self, source: T_from, /) -> T_to:
        return self.adapt(source)

    def adapt(self, source: T_from, /) -> T_to:
        raise NotImplementedError(f"{type(self).__name__} does not define adapt(source)")


class TraceAdapter(Adapter[Sequence[Span], T_to], Generic[T_to]):
    """An adapter of stored spans (lightning.types.Span, what `store.query_spans` answers)."""


class OtelTraceAdapter(Adapter[Sequence[Any], T_to], Generic[T_to]):
    """An adapter of OpenTelemetry SDK spans (`ReadableSpan`); `Span.from_opentelemetry` makes stored spans of them."""


__all__ = ["Adapter", "OtelTraceAdapter", "TraceAdapter"]
