"""agent-lightning's triplet adapters by their names, over our `spans_to_triplets`: `TracerTraceToTriplet` (agl's
default adapter, options included) and `LlmProxyTraceToTriplet`. `adapt(spans)` answers agl's triplet shape
(`prompt={"token_ids": [...]}`, `response={"token_ids": [...]}`, metadata with `response_id`) for code that reads
triplets itself, e.g. a custom algorithm calling `self.get_adapter().adapt(spans)`.

Given to `Trainer(adapter=...)`, either one (or agl's dict of TracerTraceToTriplet's options) says how a run makes
its training rows; `trainer_fields` checks that the run can make them so:

- the calls a run trains on are the spans its LLM proxy records (with their token ids), which our adapter finds by
  their own names: `llm_call_match` other than agl's default has nothing to select among them;
- `agent_match`: proxy spans are not nested under the agent's spans, so no call would match (agl reads the spans of
  its tracer in the agent's process); to train one agent of several, give the others an LLM resource other than the
  trained one;
- `reward_match`: every row of a rollout is trained on the rollout's final reward, as agl's VERL trainer does
  (its daemon takes the last reward of the rollout's triplets for all of them), whichever policy matched them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from lightning.adapter.base import TraceAdapter
from lightning.adapter.triplets import DEFAULT_LLM_SPAN_NAME, RewardMatch, spans_to_triplets
from lightning.semconv import GEN_AI_RESPONSE_ID
from lightning.types import Span, Triplet

AGL_LLM_CALL_MATCH = r"openai\.chat\.completion"
"""agl's default `llm_call_match`: its tracer's OpenAI spans. Ours (DEFAULT_LLM_SPAN_NAME) matches them and the
proxy's GenAI spans, and is used in its place."""


class RewardMatchPolicy(StrEnum):
    """agl's policies for matching a reward to an LLM call: ours are `first_sibling` and `first_after`."""

    FIRST_SIBLING = "first_sibling"
    FIRST_OCCURRENCE = "first_occurrence"


_REWARD_MATCH: dict[RewardMatchPolicy, RewardMatch] = {
    RewardMatchPolicy.FIRST_SIBLING: "first_sibling",
    RewardMatchPolicy.FIRST_OCCURRENCE: "first_after",
}


class TraceToTripletBase(TraceAdapter[list[Triplet]]):
    """agl's base class of adapters from spans to triplets."""

    def trainer_fields(self) -> dict[str, Any]:
        """The TrainConfig fields this adapter means for a run; raises ValueError where a run cannot adapt so."""
        raise ValueError(
            f"Trainer(adapter={type(self).__name__}(...)): a run makes its training rows with lightning's adapter in "
            "the flow (adapter_shape='transition' or 'trajectory'); an adapter of your own runs in a custom "
            "Algorithm, which reads it with self.get_adapter()"
        )


class TracerTraceToTriplet(TraceToTripletBase):
    """agl's default adapter: a triplet per LLM call of the spans. `llm_call_match` (a regex on span names),
    `agent_match` (a regex on the name of the nearest agent span above the call; calls under none are left out) and
    `reward_match` (FIRST_OCCURRENCE: the first reward after the call; FIRST_SIBLING: the first among the call's later
    siblings) as agl's. Our adapter always places spans whose parent is missing by their timing and always leaves out
    LLM calls inside reward code, so `repair_hierarchy=False` and `exclude_llm_call_in_reward=False` are refused.
    Calls without token ids (an agent's own OpenAI client) give no triplet, and neither do the calls of a rollout with
    no reward at all (agl gives them with reward None)."""

    def __init__(
        self,
        repair_hierarchy: bool = True,
        llm_call_match: str = AGL_LLM_CALL_MATCH,
        agent_match: str | None = None,
        exclude_llm_call_in_reward: bool = True,
        reward_match: RewardMatchPolicy | str = RewardMatchPolicy.FIRST_OCCURRENCE,
        _skip_empty_token_spans: bool = False,
    ) -> None:
        if not repair_hierarchy:
            raise ValueError(
                "TracerTraceToTriplet(repair_hierarchy=False): lightning's adapter always places a span whose parent "
                "is not among the spans under the span that encloses it in time; leave repair_hierarchy out"
            )
        if not exclude_llm_call_in_reward:
            raise ValueError(
                "TracerTraceToTriplet(exclude_llm_call_in_reward=False): lightning's adapter always leaves out LLM "
                "calls made inside reward code (a judge's calls are not the policy's); leave it out"
            )
        self.repair_hierarchy = repair_hierarchy
        self.llm_call_match = llm_call_match
        self.agent_match = agent_match
        self.exclude_llm_call_in_reward = exclude_llm_call_in_reward
        self.reward_match = RewardMatchPolicy(reward_match)
        self._agent_pattern = re.compile(agent_match) if agent_match is not None else None
        self._llm_span_name = DEFAULT_LLM_SPAN_NAME if llm_call_match == AGL_LLM_CALL_MATCH else llm_call_match
        re.compile(self._llm_span_name)

    def adapt(self, source: Sequence[Any], /) -> list[Triplet]:
        return _agl_triplets(
            source,
            reward_match=_REWARD_MATCH[self.reward_match],
            agent_name=self._agent_pattern,
            llm_span_name=self._llm_span_name,
        )

    def trainer_fields(self) -> dict[str, Any]:
        if self.agent_match is not None:
            raise ValueError(
                f"Trainer(adapter=...agent_match={self.agent_match!r}): a run trains on the calls its LLM proxy "
                "records, which are not nested under the agent's spans, so no call would match; every call through "
                "the trained LLM resource is trained. To leave an agent's calls out, give that agent an LLM resource "
                "other than the trained one (Trainer(initial_resources={'main_llm': ..., 'other': LLM(...)}))"
            )
        if self.llm_call_match != AGL_LLM_CALL_MATCH:
            raise ValueError(
                f"Trainer(adapter=...llm_call_match={self.llm_call_match!r}): a run trains on the calls its LLM proxy "
                "records, which lightning's adapter finds itself; leave llm_call_match out (it applies to adapt())"
            )
        return {}


class LlmProxyTraceToTriplet(TraceToTripletBase):
    """agl's adapter of its LLM proxy's spans: a triplet per call with token ids, in sequence order, each rewarded
    with the first reward after it (agl gives a reward to the last call before it only; a run trains every row on
    the rollout's final reward either way). Our proxy's spans are what a run trains on, so a run takes it as it is."""

    def adapt(self, source: Sequence[Any], /) -> list[Triplet]:
        return _agl_triplets(source, reward_match="first_after", agent_name=None, llm_span_name=DEFAULT_LLM_SPAN_NAME)

    def trainer_fields(self) -> dict[str, Any]:
        return {}


def _agl_triplets(
    source: Sequence[Any], *, reward_match: RewardMatch, agent_name: re.Pattern[str] | None, llm_span_name: str
) -> list[Triplet]:
    """The triplets of the spans, attempt by attempt in the order the attempts first appear, in agl's shape."""
    spans = [span if isinstance(span, Span) else Span.from_opentelemetry(span, "dummy", "dummy", 0) for span in source]
    attempts: dict[tuple[str, str], list[Span]] = {}
    for span in spans:
        attempts.setdefault((span.rollout_id, span.attempt_id), []).append(span)
    by_id = {span.span_id: span for span in spans}
    triplets = []
    for attempt_spans in attempts.values():
        adapted = spans_to_triplets(
            attempt_spans, reward_match=reward_match, agent_name=agent_name, llm_span_name=llm_span_name
        )
        for triplet in adapted.triplets:
            call = by_id.get(triplet.metadata.get("span_id", ""))
            response_id = call.attributes.get(GEN_AI_RESPONSE_ID) if call is not None else None
            triplets.append(
                Triplet(
                    prompt={"token_ids": triplet.prompt},
                    response={"token_ids": triplet.response},
                    reward=triplet.reward,
                    metadata={**triplet.metadata, "response_id": response_id},
                )
            )
    return triplets


__all__ = [
    "AGL_LLM_CALL_MATCH",
    "LlmProxyTraceToTriplet",
    "RewardMatchPolicy",
    "TraceToTripletBase",
    "TracerTraceToTriplet",
]
