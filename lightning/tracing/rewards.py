"""Reading rewards back from spans: ours, and agent-lightning 0.2/0.3 reward spans."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.types import Span

# agent-lightning 0.3's emit_reward writes an `agentlightning.annotation` span whose reward list is flattened
# into `agentlightning.reward.<i>.name` / `.value`, the primary reward first; 0.2 wrote an
# `agentlightning.reward` span with a plain `reward` attribute.
PEER_ANNOTATION_SPAN = semconv.PEER_ANNOTATION_SPAN
PEER_PRIMARY_REWARD = semconv.PEER_PRIMARY_REWARD
PEER_LEGACY_REWARD = "reward"


def get_reward_value(span: Span) -> float | None:
    """The primary reward a span carries, or None when it is not a reward span."""
    attributes = span.attributes
    if span.name == semconv.REWARD_SPAN:
        return _finite(attributes.get(semconv.REWARD_VALUE))
    if PEER_PRIMARY_REWARD in attributes:
        return _finite(attributes[PEER_PRIMARY_REWARD])
    if span.name in (semconv.PEER_REWARD_SPAN, PEER_ANNOTATION_SPAN):
        return _finite(attributes.get(PEER_LEGACY_REWARD))
    return None


class RewardDimension(BaseModel):
    """One reward of a reward span: its name and value (agent-lightning's `RewardPydanticModel`)."""

    name: str
    value: float


RewardPydanticModel = RewardDimension
"""agent-lightning's name for a reward dimension."""

_PEER_DIMENSION = re.compile(r"^agentlightning\.reward\.(\d+)\.(name|value)$")


def get_rewards_from_span(span: Span) -> list[RewardDimension]:
    """The rewards a span carries, the primary first (agent-lightning's reader): its `agentlightning.reward.<i>`
    dimensions (agl's spans, and ours, which carry them too), else our primary reward and named components; [] for a
    span that carries none."""
    attributes = span.attributes or {}
    dimensions: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        found = _PEER_DIMENSION.match(key)
        if found:
            dimensions.setdefault(int(found.group(1)), {})[found.group(2)] = value
    if dimensions:
        return [RewardDimension.model_validate(dimensions[index]) for index in sorted(dimensions)]
    primary = get_reward_value(span)
    if primary is None:
        return []
    primary_key = attributes.get(semconv.REWARD_PRIMARY_KEY)
    named = [
        RewardDimension(name=key.removeprefix(semconv.REWARD_PREFIX), value=value)
        for key, value in attributes.items()
        if key.startswith(semconv.REWARD_PREFIX)
        and key not in (semconv.REWARD_VALUE, semconv.REWARD_PRIMARY_KEY)
        and key != semconv.REWARD_PREFIX + str(primary_key)
        and isinstance(value, int | float)
    ]
    return [RewardDimension(name=str(primary_key or "primary"), value=primary), *named]


def is_reward_span(span: Span) -> bool:
    """Whether the span carries a reward (ours, or agent-lightning's)."""
    return get_reward_value(span) is not None


def find_reward_spans(spans: Sequence[Span]) -> list[Span]:
    """The spans that carry a reward, in the order given."""
    return [span for span in spans if is_reward_span(span)]


def find_rewards(spans: Sequence[Span]) -> list[float]:
    """The primary reward of each reward span, in sequence order."""
    ordered = sorted(spans, key=lambda span: span.sequence_id)
    return [reward for span in ordered if (reward := get_reward_value(span)) is not None]


def find_final_reward(spans: Sequence[Span]) -> float | None:
    """The last reward in sequence order, or None when there is none."""
    rewards = find_rewards(spans)
    return rewards[-1] if rewards else None


async def get_final_reward(store: LightningStore, rollout_id: str, attempt_id: str = "latest") -> float | None:
    """The final reward of one attempt (by default the rollout's latest), read from the store."""
    if attempt_id == "latest":
        attempt = await store.get_latest_attempt(rollout_id)
        if attempt is None:
            return None
        attempt_id = attempt.attempt_id
    # Only the spans that can hold a reward: the others may carry whole prompts and token ids.
    candidates = await store.query_spans(
        rollout_id, attempt_id, name_contains="reward", name=PEER_ANNOTATION_SPAN, filter_logic="or"
    )
    return find_final_reward(list(candidates))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and abs(value) <= semconv.REWARD_LIMIT else None
