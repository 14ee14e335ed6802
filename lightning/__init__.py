"""lightning: train LLM agents with reinforcement learning. The library; it never imports Prefect.

`import lightning as agl` gives an agent-lightning 0.3 script the names it uses (`agl.LitAgent`, `agl.rollout`,
`agl.emit_reward`, `agl.Trainer`, ...), and agl's module paths resolve below it (`from lightning.litagent import
rollout`; see lightning.agl_import_paths). An agl name with no counterpart raises `NotInLightning` (an ImportError)
saying what to use instead. Every name loads on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from lightning import agl_import_paths

if TYPE_CHECKING:  # what the names below are, for type checkers and editors; at run time each loads on first use
    from lightning.agent import Hook, LitAgent, RolloutRawResult, llm_rollout, prompt_rollout, rollout  # noqa: F401
    from lightning.agl_algorithms import APO, VERL, Algorithm, algo  # noqa: F401
    from lightning.env_var import (  # noqa: F401
        LightningEnvVar,
        resolve_bool_env_var,
        resolve_int_env_var,
        resolve_str_env_var,
    )
    from lightning.log_setup import configure_logger  # noqa: F401
    from lightning.log_setup import setup as setup_logging  # noqa: F401
    from lightning.log_setup import setup_module as setup_module_logging  # noqa: F401
    from lightning.store import LightningStore, SqlLightningStore  # noqa: F401
    from lightning.types import (  # noqa: F401
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

# Every public name loads on first use (`import lightning.owner` must not import the store, SQLAlchemy or torch:
# a command takes a run's lock before anything heavy). name -> (module, attribute).
_LAZY: dict[str, tuple[str, str]] = {
    **{name: ("lightning.types", name) for name in (
        "LLM",
        "Attempt",
        "AttemptedRollout",
        "AttemptStatus",
        "Attributes",
        "AttributeValue",
        "EnqueueRolloutRequest",
        "Event",
        "Link",
        "NamedResources",
        "OtelResource",
        "PaginatedResult",
        "PromptTemplate",
        "ProxyLLM",
        "Resource",
        "ResourcesUpdate",
        "ResourceUnion",
        "Rollout",
        "RolloutConfig",
        "RolloutMode",
        "RolloutStatus",
        "Span",
        "SpanContext",
        "SpanLike",
        "StatusCode",
        "TaskInput",
        "TraceState",
        "TraceStatus",
        "Triplet",
        "Worker",
        "WorkerStatus",
        "Dataset",
    )},
    **{name: ("lightning.agent", name) for name in (
        "Hook", "LitAgent", "RolloutRawResult", "llm_rollout", "prompt_rollout", "rollout",
    )},
    "configure_logger": ("lightning.log_setup", "configure_logger"),
    "setup_logging": ("lightning.log_setup", "setup"),
    "setup_module_logging": ("lightning.log_setup", "setup_module"),
    "LightningStore": ("lightning.store", "LightningStore"),
    "SqlLightningStore": ("lightning.store", "SqlLightningStore"),
    "Trainer": ("lightning.trainer", "Trainer"),
    "TrainConfig": ("lightning.config", "TrainConfig"),
    "TrainerConfig": ("lightning.algorithm.config", "TrainerConfig"),
    "Runner": ("lightning.runner", "Runner"),
    "LitAgentRunner": ("lightning.runner", "LitAgentRunner"),
    **{name: ("lightning.tracing", name) for name in (
        "Tracer", "OtelTracer", "AgentOpsTracer", "SpanCoreFields", "emit_reward", "emit_message", "emit_object",
        "emit_exception", "emit_annotation", "operation",
        "find_final_reward", "find_rewards", "find_reward_spans", "is_reward_span", "get_reward_value",
        "get_final_reward", "get_rewards_from_span", "get_message_value", "get_object_value", "get_active_tracer",
    )},
    "SpanNames": ("lightning.semconv", "SpanNames"),
    "SpanAttributeNames": ("lightning.semconv", "SpanAttributeNames"),
    **{name: ("lightning.adapter", name) for name in (
        "TraceToMessages", "Adapter", "TraceAdapter", "OtelTraceAdapter", "TraceToTripletBase", "TracerTraceToTriplet",
        "LlmProxyTraceToTriplet",
    )},
    **{name: ("lightning.agl_execution", name) for name in (
        "ExecutionStrategy", "SharedMemoryExecutionStrategy", "ClientServerExecutionStrategy", "ExecutionEvent",
        "ThreadingEvent", "MultiprocessingEvent",
    )},
    **{name: ("lightning.agl_algorithms", name) for name in (
        "APO", "VERL", "Algorithm", "algo", "FastAlgorithm", "Baseline",
    )},
    **{name: ("lightning.env_var", name) for name in (
        "LightningEnvVar", "resolve_bool_env_var", "resolve_int_env_var", "resolve_str_env_var",
    )},
    "LightningStoreClient": ("lightning.store.client", "LightningStoreClient"),
    "LLMProxy": ("lightning.agl_llm_proxy", "LLMProxy"),
    "LightningStoreServer": ("lightning.store.agl_server", "LightningStoreServer"),
    "LightningStoreThreaded": ("lightning.store.agl_server", "LightningStoreThreaded"),
    "LightningStoreCapabilities": ("lightning.store.base", "LightningStoreCapabilities"),
    "LightningStoreStatistics": ("lightning.store.base", "LightningStoreStatistics"),
    "InMemoryLightningStore": ("lightning.store.memory", "InMemoryLightningStore"),
}  # fmt: skip
# agent-lightning's submodules (agl.litagent, agl.store, ...) as attributes, imported on first use.
_SUBMODULES = frozenset(
    {"adapter", "algorithm", "config", "emitter", "env_var", "execution", "litagent", "logging", "reward", "runner",
     "semconv", "store", "tracer", "trainer", "types"}
)  # fmt: skip

sys.meta_path.append(agl_import_paths.FINDER)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"lightning.{name}")
    agl_import_paths.missing(__name__, name)


__all__ = sorted(_LAZY)  # every public name is one that loads on first use
