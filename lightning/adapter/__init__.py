"""Adapters: the spans of rollout attempts -> training data (token triplets, chat transcripts)."""

from typing import Any

from lightning.adapter.agl_triplet import (
    LlmProxyTraceToTriplet,
    RewardMatchPolicy,
    TracerTraceToTriplet,
    TraceToTripletBase,
)
from lightning.adapter.base import Adapter, OtelTraceAdapter, TraceAdapter
from lightning.adapter.messages import TraceToMessages, Transcript, spans_to_messages
from lightning.adapter.tree import SpanNode, build_forest, iter_forest
from lightning.adapter.triplets import (
    DEFAULT_LLM_SPAN_NAME,
    AdaptReport,
    AdaptResult,
    RewardMatch,
    Shape,
    adapt_rollouts,
    spans_to_triplets,
)
from lightning.agl_import_paths import missing


def __getattr__(name: str) -> Any:
    missing(__name__, name)


__all__ = [
    "DEFAULT_LLM_SPAN_NAME",
    "AdaptReport",
    "AdaptResult",
    "Adapter",
    "LlmProxyTraceToTriplet",
    "OtelTraceAdapter",
    "RewardMatchPolicy",
    "TraceAdapter",
    "TraceToTripletBase",
    "TracerTraceToTriplet",
    "RewardMatch",
    "Shape",
    "SpanNode",
    "TraceToMessages",
    "Transcript",
    "adapt_rollouts",
    "build_forest",
    "iter_forest",
    "spans_to_messages",
    "spans_to_triplets",
]
