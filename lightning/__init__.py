"""lightning: train LLM agents with reinforcement learning. The library; it never imports Prefect."""

from lightning.store import LightningStore, SqlLightningStore
from lightning.types import (
    LLM,
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Triplet,
    Worker,
)

__all__ = [
    "LLM",
    "Attempt",
    "AttemptedRollout",
    "EnqueueRolloutRequest",
    "LightningStore",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "Span",
    "SqlLightningStore",
    "Triplet",
    "Worker",
]
