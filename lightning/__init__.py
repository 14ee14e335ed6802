"""lightning: train LLM agents with reinforcement learning. The library; it never imports Prefect.

`import lightning as agl` gives an agent-lightning 0.3 script the names it uses (`agl.LitAgent`, `agl.rollout`,
`agl.emit_reward`, `agl.Trainer`, ...), and agl's module paths resolve below it (`from lightning.litagent import
rollout`; see lightning.agl_import_paths). An agl name with no counterpart raises `NotInLightning` (an ImportError)
saying what to use instead. The heavier names (tracing, runner, trainer) load on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning import agl_import_paths
from lightning.agent import Hook, LitAgent, RolloutRawResult, llm_rollout, prompt_rollout, rollout
from lightning.log_setup import configure_logger
from lightning.log_setup import setup as setup_logging
from lightning.log_setup import setup_module as setup_module_logging
from lightning.store import LightningStore, SqlLightningStore
from lightning.types import (
    LLM,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Attributes,
    AttributeValue,
    EnqueueRolloutRequest,
    Event,
    Link,
    NamedResources,
    OtelResource,
    PaginatedResult,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
    ResourceUnion,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    SpanContext,
    SpanLike,
    StatusCode,
    TaskInput,
    TraceState,
    TraceStatus,
    Triplet,
    Worker,
    WorkerStatus,
)

# Loaded on first use: name -> module.
_LAZY = {
    "Dataset": "lightning.types",
    "Trainer": "lightning.trainer",
    "TrainConfig": "lightning.config",
    "TrainerConfig": "lightning.algorithm.config",
    "Runner": "lightning.runner",
    "LitAgentRunner": "lightning.runner",
    "Tracer": "lightning.tracing",
    "SpanCoreFields": "lightning.tracing",
    "emit_reward": "lightning.tracing",
    "emit_message": "lightning.tracing",
    "emit_object": "lightning.tracing",
    "emit_exception": "lightning.tracing",
    "operation": "lightning.tracing",
    "find_final_reward": "lightning.tracing",
    "find_rewards": "lightning.tracing",
    "find_reward_spans": "lightning.tracing",
    "is_reward_span": "lightning.tracing",
    "get_reward_value": "lightning.tracing",
    "get_final_reward": "lightning.tracing",
    "TraceToMessages": "lightning.adapter",
    "LightningStoreClient": "lightning.store.client",
    "InMemoryLightningStore": "lightning.store.memory",
}
# agent-lightning's submodules (agl.litagent, agl.store, ...) as attributes, imported on first use.
_SUBMODULES = frozenset(
    {"adapter", "algorithm", "config", "emitter", "litagent", "logging", "reward", "runner", "semconv", "store",
     "tracer", "trainer", "types"}
)  # fmt: skip

sys.meta_path.append(agl_import_paths.FINDER)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"lightning.{name}")
    agl_import_paths.missing(__name__, name)


__all__ = [
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "AttributeValue",
    "Attributes",
    "Dataset",
    "EnqueueRolloutRequest",
    "Event",
    "Hook",
    "InMemoryLightningStore",
    "LLM",
    "LightningStore",
    "LightningStoreClient",
    "Link",
    "LitAgent",
    "LitAgentRunner",
    "NamedResources",
    "OtelResource",
    "PaginatedResult",
    "PromptTemplate",
    "ProxyLLM",
    "Resource",
    "ResourceUnion",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutMode",
    "RolloutRawResult",
    "RolloutStatus",
    "Runner",
    "Span",
    "SpanContext",
    "SpanCoreFields",
    "SpanLike",
    "SqlLightningStore",
    "StatusCode",
    "TaskInput",
    "TraceState",
    "TraceStatus",
    "TraceToMessages",
    "Tracer",
    "TrainConfig",
    "Trainer",
    "TrainerConfig",
    "Triplet",
    "Worker",
    "WorkerStatus",
    "configure_logger",
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
    "llm_rollout",
    "operation",
    "prompt_rollout",
    "rollout",
    "setup_logging",
    "setup_module_logging",
]
