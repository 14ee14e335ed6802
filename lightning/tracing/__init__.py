"""Tracing: spans from a private OpenTelemetry provider, attributed to rollout attempts, written to the store."""

from lightning.tracing.emitters import (
    Operation,
    SpanCoreFields,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    is_secret_name,
    operation,
    reward,
)
from lightning.tracing.rewards import (
    find_final_reward,
    find_reward_spans,
    find_rewards,
    get_final_reward,
    get_reward_value,
    is_reward_span,
)
from lightning.tracing.tracer import AgentOpsTracer, OtelTracer, SpanExportError, TraceContext, Tracer

__all__ = [
    "AgentOpsTracer",
    "Operation",
    "OtelTracer",
    "SpanCoreFields",
    "SpanExportError",
    "TraceContext",
    "Tracer",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "find_rewards",
    "get_final_reward",
    "get_reward_value",
    "is_reward_span",
    "is_secret_name",
    "operation",
    "reward",
]
