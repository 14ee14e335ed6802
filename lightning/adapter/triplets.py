"""Spans -> triplets: the LLM calls of each rollout attempt, with their exact token ids and matched reward.

The rules, each applied in one place below:

- An LLM call is a span whose name matches `llm_span_name` (default: GenAI's "chat <model>",
  "text_completion <model>", and agent-lightning 0.3's "openai.chat.completion") or whose
  `gen_ai.operation.name` is "chat" or "text_completion". A call span with another call span below it
  (a client-side span around the proxy's) is a wrapper: the inner one is used, the wrapper skipped and counted.
- A call is in reward code, skipped and counted, when one of its ancestors (after timing repair) is a reward
  span, or a span whose name or `lightning.operation.name` contains "reward" or "judge" (any case).
- `agent_name` keeps the calls whose nearest agent ancestor-or-self is that agent (a compiled `re.Pattern`: whose
  name it finds, `re.search`, as agent-lightning's `agent_match`); an agent span is one
  with attribute `agent.name`, `lightning.agent.name` or `gen_ai.agent.name`, or named `agent <name>` or
  `invoke_agent <name>`. Calls under no agent span are dropped by the filter, and counted.
- A call is usable when it has prompt and response token ids: `lightning.llm.prompt_token_ids` and
  `lightning.llm.response_token_ids` (one encoding per choice), or agent-lightning 0.3's plain int lists
  `prompt_token_ids` / `response_token_ids`. A call without them is dropped and counted. A call with n
  choices gives n transitions, all with the same turn index.
- Rewards come from reward spans as `lightning.tracing.rewards.get_reward_value` reads them. A rollout
  with no reward at all has its triplets dropped (a missing reward is never made 0) and is counted; a
  triplet whose policy finds no reward in a rollout that has some is dropped and counted too.
- An empty response is kept when its prompt is not empty (the reward still applies), and counted.
- Trajectory rows grow turn by turn only while each prompt starts with the previous prompt + response;
  otherwise the row ends and a new one starts (counted as a split, with its reason: the proxy's note on the call,
  `lightning.llm.continuation`, when it could not join it). A row's reward is its last turn's. Of a call's n>1
  choices a row follows the one the next prompt extends (else the first); the others are counted as unused choices.
- Groups for group-relative advantages: a trajectory row is grouped with the rows of its task (`group_id`); a
  transition with the transitions of the same task and the same turn index (`advantage_group`), so a group never
  mixes a first call's prompt with a later call's.
"""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from lightning import semconv
from lightning.adapter.tree import SpanNode, build_forest, iter_forest
from lightning.store.base import LightningStore
from lightning.tracing.rewards import find_final_reward, get_reward_value, is_reward_span
from lightning.types import Rollout, Span, Triplet

Shape = Literal["transition", "trajectory"]
RewardMatch = Literal["final", "first_after", "first_sibling"]
"""How an LLM call finds its reward:
- "final": the rollout's final reward (the last reward span in sequence order), for every call;
- "first_after": the first reward span (by start time) that starts after the call ended;
- "first_sibling": the first reward span among the call's later siblings in the tree (the sibling spans
  themselves, not their descendants; roots are siblings of each other)."""

DEFAULT_LLM_SPAN_NAME = r"^(?:(?:chat|text_completion)(?: .+)?|openai\.chat\.completion)$"
LLM_OPERATIONS = ("chat", "text_completion")
REWARD_CODE_NAME = re.compile(r"reward|judge", re.IGNORECASE)
AGENT_NAME_ATTRIBUTES = ("agent.name", "lightning.agent.name", "gen_ai.agent.name")
AGENT_SPAN_PREFIXES = ("agent ", "invoke_agent ")
PEER_PROMPT_TOKEN_IDS = "prompt_token_ids"
PEER_RESPONSE_TOKEN_IDS = "response_token_ids"
MAX_PROBLEMS = 20


class AdaptReport(BaseModel):
    """What the adapter saw and what it dropped, so that nothing is lost silently."""

    rollouts: int = 0
    rollouts_missing: int = 0
    """Rollout ids the store does not know."""
    rollouts_with_triplets: int = 0
    rollouts_without_llm_calls: int = 0
    rollouts_without_reward: int = 0
    """Rollouts with no reward span: all their triplets were dropped."""
    llm_calls: int = 0
    """LLM calls considered: after the reward-code, wrapper and agent rules."""
    calls_without_token_ids: int = 0
    """Answered calls recorded without token ids: the agent's own client, not the run's proxy."""
    failed_calls: int = 0
    """Calls the run's proxy answered with an error (HTTP 4xx/5xx: too long for the model's context, ...): no
    tokens to train on, and not a client problem."""
    calls_in_reward_code_skipped: int = 0
    calls_filtered_by_agent: int = 0
    wrapper_llm_spans_skipped: int = 0
    triplets_without_matched_reward: int = 0
    """Triplets dropped because the reward policy found no reward for them (the rollout had some)."""
    empty_responses: int = 0
    trajectory_splits: int = 0
    unused_choices: int = 0
    """Trajectory shape: choices of n>1 calls that the conversation did not continue from."""
    split_reasons: dict[str, int] = Field(default_factory=dict)
    """Trajectory splits by reason."""
    tool_calls: int = 0
    """Tool calls in the LLM calls' answers (each call's first choice)."""
    rollouts_with_tool_calls: int = 0
    tokens_trained: int = 0
    """Response tokens of the triplets kept that the model generated (mask 1)."""
    tokens_masked: int = 0
    """Response tokens of the triplets kept that it did not (mask 0: tool results, user text, template glue)."""
    problems: list[str] = Field(default_factory=list)
    """The first MAX_PROBLEMS problems, one line each, naming the rollout."""

    def problem(self, line: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(line)

    def split(self, reason: str) -> None:
        self.trajectory_splits += 1
        self.split_reasons[reason] = self.split_reasons.get(reason, 0) + 1

    def turn_metrics(self) -> dict[str, Any]:
        """For agents that make several LLM calls or call tools, an iteration's: LLM calls (turns) and tool calls a
        rollout, the share of rollouts that called a tool, response tokens trained and masked, trajectory splits.
        Empty for a one-call agent without tools."""
        with_calls = self.rollouts - self.rollouts_without_llm_calls
        if with_calls <= 0 or (self.llm_calls <= with_calls and not self.tool_calls):
            return {}
        return {
            "turns": self.llm_calls / with_calls,
            "tool_calls": self.tool_calls / with_calls,
            "tool_use": self.rollouts_with_tool_calls / with_calls,
            "tokens_trained": self.tokens_trained,
            "tokens_masked": self.tokens_masked,
            "trajectory_splits": self.trajectory_splits,
        }

    def add(self, other: AdaptReport) -> None:
        for name in type(self).model_fields:
            if name not in ("problems", "split_reasons"):
                setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, count in other.split_reasons.items():
            self.split_reasons[reason] = self.split_reasons.get(reason, 0) + count
        for line in other.problems:
            self.problem(line)


class AdaptResult(BaseModel):
    triplets: list[Triplet] = Field(default_factory=list)
    report: AdaptReport = Field(default_factory=AdaptReport)


@dataclass
class LlmCall:
    """One LLM call that counts: its node in the forest, its turn and its reward (None: none matched)."""

    node: SpanNode
    turn_index: int
    """Its place among the rollout's calls that count, in start-time order, from 0."""
    reward: float | None

    @property
    def span(self) -> Span:
        return self.node.span


@dataclass
class _Tokens:
    prompts: list[list[int]]
    """One prompt per choice (the same one, except for a completions call with several prompts)."""
    responses: list[list[int]]
    logprobs: list[list[float]] | None = None
    """The sampler's log-prob of each response token, one list per choice, when the span has them."""


def spans_to_triplets(
    spans: Sequence[Span],
    *,
    shape: Shape = "transition",
    reward_match: RewardMatch = "final",
    agent_name: str | re.Pattern[str] | None = None,
    llm_span_name: str = DEFAULT_LLM_SPAN_NAME,
    group_id: str | None = None,
) -> AdaptResult:
    """The triplets of one rollout attempt's spans (group id: `group_id`, else the rollout id)."""
    if not spans:
        return AdaptResult()
    attempts = {(span.rollout_id, span.attempt_id) for span in spans}
    if len(attempts) > 1:
        raise ValueError(f"spans_to_triplets takes the spans of one attempt, got {len(attempts)}: {sorted(attempts)}")
    rollout_id, attempt_id = attempts.pop()
    return _adapt_attempt(
        rollout_id,
        attempt_id,
        spans,
        shape=shape,
        reward_match=reward_match,
        agent_name=agent_name,
        llm_span_name=llm_span_name,
        group_id=group_id or rollout_id,
    )


async def adapt_rollouts(
    store: LightningStore,
    rollout_ids: Sequence[str],
    *,
    shape: Shape = "transition",
    reward_match: RewardMatch = "final",
    agent_name: str | re.Pattern[str] | None = None,
    llm_span_name: str = DEFAULT_LLM_SPAN_NAME,
    group_id: str | None = None,
) -> AdaptResult:
    """The triplets of each rollout's latest attempt, concatenated in the order of `rollout_ids`.

    Group id: `group_id` when given (then the same for every rollout), else the rollout's metadata
    "group_id", else the rollout id. The rollout's status is not checked: the caller decides which rollouts
    to adapt. A rollout id the store does not know is counted in `rollouts_missing`."""
    result = AdaptResult()
    for rollout_id, rollout, spans in await _rollouts_and_spans(store, rollout_ids):
        if rollout is None:
            result.report.rollouts_missing += 1
            result.report.problem(f"rollout {rollout_id}: not in the store")
            continue
        attempt_id = spans[0].attempt_id if spans else "latest"
        one = _adapt_attempt(
            rollout_id,
            attempt_id,
            spans,
            shape=shape,
            reward_match=reward_match,
            agent_name=agent_name,
            llm_span_name=llm_span_name,
            group_id=group_id or (rollout.metadata or {}).get("group_id") or rollout_id,
        )
        result.triplets.extend(one.triplets)
        result.report.add(one.report)
    return result


READ_CHUNK = 256
"""Rollouts read per pair of store requests (their rows, their latest attempts' spans)."""


async def _rollouts_and_spans(
    store: LightningStore, rollout_ids: Sequence[str]
) -> list[tuple[str, Rollout | None, list[Span]]]:
    """Each rollout (None if the store does not know it) with its latest attempt's spans, two requests per
    READ_CHUNK rollouts rather than two per rollout."""
    found: list[tuple[str, Rollout | None, list[Span]]] = []
    for start in range(0, len(rollout_ids), READ_CHUNK):
        chunk = list(rollout_ids[start : start + READ_CHUNK])
        rows = {rollout.rollout_id: rollout for rollout in await store.query_rollouts(rollout_id_in=chunk)}
        spans = await store.query_latest_spans(chunk)
        found.extend((rollout_id, rows.get(rollout_id), spans.get(rollout_id, [])) for rollout_id in chunk)
    return found


def _adapt_attempt(
    rollout_id: str,
    attempt_id: str,
    spans: Sequence[Span],
    *,
    shape: Shape,
    reward_match: RewardMatch,
    agent_name: str | re.Pattern[str] | None,
    llm_span_name: str,
    group_id: str,
) -> AdaptResult:
    if shape not in ("transition", "trajectory"):
        raise ValueError(f"shape must be 'transition' or 'trajectory', got {shape!r}")
    report = AdaptReport(rollouts=1)
    where = f"rollout {rollout_id} (attempt {attempt_id})"
    calls = select_llm_calls(spans, report, reward_match=reward_match, agent_name=agent_name, pattern=llm_span_name)
    if not calls:
        report.rollouts_without_llm_calls += 1
        report.problem(f"{where}: no LLM call spans")
        return AdaptResult(report=report)

    usable: list[tuple[LlmCall, _Tokens]] = []
    for call in calls:
        tokens = _token_ids(call.span)
        status = call.span.attributes.get(semconv.LLM_HTTP_STATUS)
        if tokens is None and isinstance(status, int) and status >= 400:
            report.failed_calls += 1
            report.problem(f"{where}: LLM call span {call.span.span_id} was answered HTTP {status} by the run's proxy")
        elif tokens is None:
            report.calls_without_token_ids += 1
            report.problem(f"{where}: LLM call span {call.span.span_id} ({call.span.name!r}) has no readable token ids")
        else:
            usable.append((call, tokens))

    tool_calls = sum(_tool_call_count(call.span) for call in calls)
    report.tool_calls += tool_calls
    report.rollouts_with_tool_calls += 1 if tool_calls else 0
    base = {"rollout_id": rollout_id, "attempt_id": attempt_id, "group_id": group_id}
    if shape == "transition":
        triplets = _transitions(usable, base, report, where)
    else:
        triplets = _trajectories(usable, base, report, where)

    if find_final_reward(spans) is None:
        report.rollouts_without_reward += 1
        report.problem(f"{where}: no reward span; its {len(triplets)} triplet(s) are dropped")
        return AdaptResult(report=report)
    kept = [triplet for triplet in triplets if triplet.reward is not None]
    if len(kept) < len(triplets):
        report.triplets_without_matched_reward += len(triplets) - len(kept)
        report.problem(
            f"{where}: {len(triplets) - len(kept)} triplet(s) found no reward under reward_match={reward_match!r}"
        )
    report.rollouts_with_triplets += 1 if kept else 0
    for triplet in kept:
        trained = sum(triplet.response_mask) if triplet.response_mask is not None else len(triplet.response)
        report.tokens_trained += trained
        report.tokens_masked += len(triplet.response) - trained
    return AdaptResult(triplets=kept, report=report)


# --- which spans are LLM calls, and their rewards ------------------------------------------------


def select_llm_calls(
    spans: Sequence[Span],
    report: AdaptReport,
    *,
    reward_match: RewardMatch = "final",
    agent_name: str | re.Pattern[str] | None = None,
    pattern: str = DEFAULT_LLM_SPAN_NAME,
) -> list[LlmCall]:
    """The LLM calls that count, in start-time order, each with its reward; what is skipped is counted."""
    if reward_match not in ("final", "first_after", "first_sibling"):
        raise ValueError(f"reward_match must be 'final', 'first_after' or 'first_sibling', got {reward_match!r}")
    name_regex = re.compile(pattern)
    roots = build_forest(spans)
    nodes = list(iter_forest(roots))
    is_call = {id(node): is_llm_call(node.span, name_regex) for node in nodes}
    final_reward = find_final_reward(spans)
    timed_rewards = sorted(
        (node.span for node in nodes if get_reward_value(node.span) is not None and node.span.start_time is not None),
        key=lambda span: (span.start_time, span.sequence_id),
    )

    calls = []
    for node in nodes:
        if not is_call[id(node)]:
            continue
        if any(_is_reward_code(ancestor.span) for ancestor in node.ancestors()):
            report.calls_in_reward_code_skipped += 1
            continue
        if any(is_call[id(descendant)] for descendant in node.walk() if descendant is not node):
            report.wrapper_llm_spans_skipped += 1
            continue
        if agent_name is not None and not _is_agent(_agent_of(node), agent_name):
            report.calls_filtered_by_agent += 1
            continue
        if reward_match == "final":
            reward = final_reward
        elif reward_match == "first_after":
            reward = _first_reward_after(node.span, timed_rewards)
        else:
            reward = _first_sibling_reward(node, roots)
        calls.append(LlmCall(node=node, turn_index=0, reward=reward))
    calls.sort(key=lambda call: (_start(call.span), call.span.sequence_id))
    for turn_index, call in enumerate(calls):
        call.turn_index = turn_index
    report.llm_calls += len(calls)
    return calls


def is_llm_call(span: Span, name_regex: re.Pattern[str]) -> bool:
    return bool(name_regex.search(span.name)) or span.attributes.get(semconv.GEN_AI_OPERATION) in LLM_OPERATIONS


def _is_reward_code(span: Span) -> bool:
    reward_span = span.name in (semconv.REWARD_SPAN, semconv.PEER_REWARD_SPAN) or is_reward_span(span)
    if reward_span or REWARD_CODE_NAME.search(span.name):
        return True
    operation = span.attributes.get(semconv.OPERATION_NAME)
    return isinstance(operation, str) and bool(REWARD_CODE_NAME.search(operation))


def _agent_of(node: SpanNode) -> str | None:
    """The name of the nearest agent span at or above `node`, or None."""
    for candidate in (node, *node.ancestors()):
        span = candidate.span
        for attribute in AGENT_NAME_ATTRIBUTES:
            if isinstance(span.attributes.get(attribute), str):
                return span.attributes[attribute]
        for prefix in AGENT_SPAN_PREFIXES:
            if span.name.startswith(prefix):
                return span.name[len(prefix) :]
    return None


def _is_agent(name: str | None, wanted: str | re.Pattern[str]) -> bool:
    if name is None:
        return False
    return name == wanted if isinstance(wanted, str) else wanted.search(name) is not None


def _first_reward_after(call: Span, timed_rewards: list[Span]) -> float | None:
    if call.end_time is None:
        return None
    for span in timed_rewards:
        if span.start_time >= call.end_time:  # type: ignore[operator]
            return get_reward_value(span)
    return None


def _first_sibling_reward(node: SpanNode, roots: list[SpanNode]) -> float | None:
    siblings = node.parent.children if node.parent is not None else roots
    for sibling in siblings[siblings.index(node) + 1 :]:
        reward = get_reward_value(sibling.span)
        if reward is not None:
            return reward
    return None


def _start(span: Span) -> float:
    return span.start_time if span.start_time is not None else float("inf")


# --- token ids ---------------------------------------------------------------------------------


def _token_ids(span: Span) -> _Tokens | None:
    """The call's prompt and per-choice response token ids, or None when the span lacks them."""
    attributes = span.attributes
    try:
        if semconv.LLM_PROMPT_TOKEN_IDS in attributes and semconv.LLM_RESPONSE_TOKEN_IDS in attributes:
            prompt = semconv.decode_token_ids(attributes[semconv.LLM_PROMPT_TOKEN_IDS])
            responses = [semconv.decode_token_ids(encoded) for encoded in attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
            choice_prompts = attributes.get(semconv.LLM_CHOICE_PROMPT_TOKEN_IDS)
            if choice_prompts and len(choice_prompts) == len(responses):
                prompts = [semconv.decode_token_ids(encoded) for encoded in choice_prompts]
            else:
                prompts = [prompt] * len(responses)
            return _Tokens(prompts, responses, _logprobs(attributes, responses)) if responses else None
    except (binascii.Error, ValueError, TypeError):
        return None
    prompt, response = attributes.get(PEER_PROMPT_TOKEN_IDS), attributes.get(PEER_RESPONSE_TOKEN_IDS)
    if _is_int_list(prompt) and _is_int_list(response):
        return _Tokens([prompt], [response])
    if _is_int_list(prompt) and isinstance(response, list) and response and all(map(_is_int_list, response)):
        return _Tokens([prompt] * len(response), response)
    return None


def _logprobs(attributes: dict[str, Any], responses: list[list[int]]) -> list[list[float]] | None:
    """The span's per-choice log-probs, if there is one list per choice and one value per response token."""
    encoded = attributes.get(semconv.LLM_RESPONSE_LOGPROBS)
    if not isinstance(encoded, list) or len(encoded) != len(responses):
        return None
    logprobs = [semconv.decode_logprobs(item) for item in encoded]
    if any(len(values) != len(response) for values, response in zip(logprobs, responses, strict=True)):
        return None
    return logprobs


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _finish_reason(span: Span, choice: int) -> str | None:
    reasons = span.attributes.get(semconv.GEN_AI_FINISH_REASONS)
    if isinstance(reasons, list) and choice < len(reasons):
        return reasons[choice] or None
    return None


def _tool_call_count(span: Span) -> int:
    """The tool calls in the call's first choice, from its GenAI output messages."""
    try:
        messages = json.loads(span.attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES) or "[]")
    except (TypeError, json.JSONDecodeError):
        return 0
    first = messages[0] if isinstance(messages, list) and messages else None
    calls = first.get("tool_calls") if isinstance(first, dict) else None
    return len(calls) if isinstance(calls, list) else 0


def _weight_version(span: Span) -> dict[str, Any]:
    version = span.attributes.get(semconv.LLM_WEIGHT_VERSION)
    return {} if version is None else {"weight_version": version}


# --- the two shapes ----------------------------------------------------------------------------


def _transitions(
    usable: list[tuple[LlmCall, _Tokens]], base: dict[str, Any], report: AdaptReport, where: str
) -> list[Triplet]:
    triplets = []
    for call, tokens in usable:
        for choice, (prompt, response) in enumerate(zip(tokens.prompts, tokens.responses, strict=True)):
            if not response:
                report.empty_responses += 1
                kept = bool(prompt)
                report.problem(
                    f"{where}: LLM call span {call.span.span_id} choice {choice} has an empty response"
                    + ("" if kept else " and an empty prompt; dropped")
                )
                if not kept:
                    continue
            metadata = {
                **base,
                "advantage_group": f"{base['group_id']}/turn-{call.turn_index}",
                "turn_index": call.turn_index,
                "choice_index": choice,
                "sequence_id": call.span.sequence_id,
                "span_id": call.span.span_id,
                "finish_reason": _finish_reason(call.span, choice),
                **_weight_version(call.span),
            }
            if tokens.logprobs is not None:
                metadata[semconv.TRIPLET_RESPONSE_LOG_PROBS] = tokens.logprobs[choice]
            triplets.append(Triplet(prompt=prompt, response=response, reward=call.reward, metadata=metadata))
    return triplets


@dataclass
class _Row:
    prompt: list[int]
    response: list[int]
    mask: list[int]
    context: list[int]
    """Everything the model has seen or said so far: the next prompt must start with it."""
    turns: list[tuple[LlmCall, int]]
    """(call, choice) of each turn in the row."""
    logprobs: list[float] | None
    """The sampler's log-prob of each response token (0.0 where the mask is 0); None if a turn had none."""


def _trajectories(
    usable: list[tuple[LlmCall, _Tokens]], base: dict[str, Any], report: AdaptReport, where: str
) -> list[Triplet]:
    rows: list[_Row] = []
    for position, (call, tokens) in enumerate(usable):
        next_prompt = usable[position + 1][1].prompts[0] if position + 1 < len(usable) else None
        choice = _continued_choice(tokens, next_prompt)
        report.unused_choices += len(tokens.responses) - 1
        prompt, response = tokens.prompts[choice], tokens.responses[choice]
        if not response:
            report.empty_responses += 1
            report.problem(f"{where}: LLM call span {call.span.span_id} has an empty response")
        row = rows[-1] if rows else None
        if row is not None and prompt[: len(row.context)] == row.context:
            appended = prompt[len(row.context) :]
            row.response += appended + response
            row.mask += [0] * len(appended) + [1] * len(response)
            row.context = prompt + response
            row.turns.append((call, choice))
            turn_logprobs = None if tokens.logprobs is None else tokens.logprobs[choice]
            row.logprobs = (
                None
                if row.logprobs is None or turn_logprobs is None
                else row.logprobs + [0.0] * len(appended) + turn_logprobs
            )
            continue
        if row is not None:
            continuation = call.span.attributes.get(semconv.LLM_CONTINUATION)
            reason = (
                continuation
                if isinstance(continuation, str) and continuation != "joined"
                else "the prompt does not extend the conversation so far"
            )
            report.split(reason)
            report.problem(f"{where}: turn {call.turn_index} starts a new row: {reason}")
        logprobs = None if tokens.logprobs is None else list(tokens.logprobs[choice])
        rows.append(_Row(prompt, list(response), [1] * len(response), prompt + response, [(call, choice)], logprobs))

    triplets = []
    for segment, row in enumerate(rows):
        if not row.prompt and not row.response:
            continue
        first, _ = row.turns[0]
        last, last_choice = row.turns[-1]
        versions = list(dict.fromkeys(call.span.attributes.get(semconv.LLM_WEIGHT_VERSION) for call, _ in row.turns))
        metadata = {
            **base,
            "turn_index": first.turn_index,
            "turn_count": len(row.turns),
            "segment_index": segment,
            "sequence_id": first.span.sequence_id,
            "span_ids": [call.span.span_id for call, _ in row.turns],
            "finish_reason": _finish_reason(last.span, last_choice),
        }
        if versions != [None]:
            metadata["weight_version" if len(versions) == 1 else "weight_versions"] = (
                versions[0] if len(versions) == 1 else versions
            )
        if row.logprobs is not None:
            metadata[semconv.TRIPLET_RESPONSE_LOG_PROBS] = row.logprobs
        triplets.append(
            Triplet(
                prompt=row.prompt, response=row.response, reward=last.reward, metadata=metadata, response_mask=row.mask
            )
        )
    return triplets


def _continued_choice(tokens: _Tokens, next_prompt: list[int] | None) -> int:
    """The choice the next turn's prompt continues from; the first choice when none does, or at the end."""
    if next_prompt is not None:
        for choice, (prompt, response) in enumerate(zip(tokens.prompts, tokens.responses, strict=True)):
            context = prompt + response
            if next_prompt[: len(context)] == context:
                return choice
    return 0
