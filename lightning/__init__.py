"""lightning: train LLM agents with reinforcement learning. The library; it never imports Prefect.

`import lightning as agl` gives an agent-lightning 0.3 script the names it uses (`agl.LitAgent`, `agl.rollout`,
`agl.emit_reward`, `agl.Trainer`, ...). The heavier ones (tracing, runner, trainer) load on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from lightning.agent import Hook, LitAgent, llm_rollout, prompt_rollout, rollout
from lightning.store import LightningStore, SqlLightningStore
from lightning.types import (
    LLM,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    TaskInput,
    Triplet,
    Worker,
)

# Loaded on first use: name -> module.
_LAZY = {
    "Dataset": "lightning.trainer",
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
    "get_reward_value": "lightning.tracing",
    "get_final_reward": "lightning.tracing",
}
_RENAMED = {"LitAgentRunner": "Runner"}

# agent-lightning names that have no counterpart here, and what to use instead.
_NOT_HERE = {
    "VERL": "give lightning.Trainer(algorithm={...}) the fields of lightning.TrainerConfig (lr, kl_coef, "
    "advantage, ...) and TrainConfig fields as keywords (batch_size, samples_per_task, max_prompt_length, ...); "
    "trainer_backend='verl' runs verl's FSDP workers",
    "APO": "prompt optimisation is the `optimize_prompt` flow: give the TrainConfig an `apo` section (the seed "
    "prompt, and APO's beam_width, branch_factor, beam_rounds, gradient_batch_size, val_batch_size, gradient_model, "
    "apply_edit_model, diversity_temperature) and run `python -m flows.optimize_prompt CONFIG.yaml` "
    "(examples/room_booking/apo.yaml)",
    "Baseline": "Trainer.dev(agent, dataset) runs one batch of rollouts without training",
    "InMemoryLightningStore": "use lightning.SqlLightningStore('sqlite://') (in memory) or a SQLite file",
    "LLMProxy": "every run starts its own LLM proxy; see TrainConfig.proxy_endpoint to use a running one",
    "AgentOpsTracer": "the tracer is the runner's (lightning.Tracer); LLM calls are recorded by the LLM proxy",
    "OtelTracer": "the tracer is the runner's (lightning.Tracer)",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), _RENAMED.get(name, name))
        globals()[name] = value
        return value
    if name in _NOT_HERE:
        raise AttributeError(f"lightning has no {name} (an agent-lightning name): {_NOT_HERE[name]}")
    raise AttributeError(f"module 'lightning' has no attribute {name!r}")


def setup_logging(level: int | str = "INFO") -> None:
    """agent-lightning's `setup_logging`: log lines with time, logger and level to stderr at `level`."""
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns what matters


def configure_logger(level: int = logging.INFO, name: str = "lightning") -> logging.Logger:
    """agent-lightning's `configure_logger`: the logger `name`, at `level`, logging to stderr."""
    setup_logging(level)
    logger = logging.getLogger(name)
    logger.setLevel(level)
    return logger


__all__ = [
    "LLM",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "Dataset",
    "EnqueueRolloutRequest",
    "Hook",
    "LightningStore",
    "LitAgent",
    "LitAgentRunner",
    "NamedResources",
    "PromptTemplate",
    "ProxyLLM",
    "Resource",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutMode",
    "RolloutStatus",
    "Runner",
    "Span",
    "SpanCoreFields",
    "SqlLightningStore",
    "TaskInput",
    "TrainConfig",
    "Trainer",
    "TrainerConfig",
    "Tracer",
    "Triplet",
    "Worker",
    "configure_logger",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_rewards",
    "get_final_reward",
    "get_reward_value",
    "llm_rollout",
    "operation",
    "prompt_rollout",
    "rollout",
    "setup_logging",
]
