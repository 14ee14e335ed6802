"""Tracing: spans from a private OpenTelemetry provider, attributed to rollout attempts, written to the store."""

from lightning.tracing.emitters import (
    Operation,
    SpanCoreFields,
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    is_secret_name,
    operation,
    reward,
)
from lightning.tracing.readers import get_message_value, get_object_value
from lightning.tracing.rewards import (
    RewardDimension,
    RewardPydanticModel,
    find_final_reward,
    find_reward_spans,
    find_rewards,
    get_final_reward,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)
from lightning.tracing.tracer import (
    AgentOpsTracer,
    OtelTracer,
    SpanExportError,
    TraceContext,
    Tracer,
    get_active_tracer,
)

__all__ = [
    "AgentOpsTracer",
    "Operation",
    "RewardDimension",
    "RewardPydanticModel",
    "OtelTracer",
    "SpanCoreFields",
    "SpanExportError",
    "TraceContext",
    "Tracer",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "find_rewards",
    "get_active_tracer",
    "get_final_reward",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "is_secret_name",
    "operation",
    "reward",
]
