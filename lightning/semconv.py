"""Names of our spans and attributes, in one place. Spans named by agent-lightning 0.3
(`agentlightning.*`) are read too, so traces from agents written for it still count."""

import array
import base64
import sys
from enum import StrEnum
from typing import Any

REWARD_SPAN = "lightning.reward"
MESSAGE_SPAN = "lightning.message"
OBJECT_SPAN = "lightning.object"
EXCEPTION_SPAN = "lightning.exception"
OPERATION_SPAN = "lightning.operation"
ANNOTATION_SPAN = "lightning.annotation"
"""`emit_annotation`'s span (agent-lightning's name for a span of attributes: tags, metadata, rewards)."""

REWARD_VALUE = "lightning.reward.value"
"""The primary reward (float) on a reward span."""
REWARD_PREFIX = "lightning.reward."
"""Prefix of named reward components: `lightning.reward.<name>` (float)."""
REWARD_PRIMARY_KEY = "lightning.reward.primary_key"
"""For a dict of rewards: which component is the primary reward."""
MESSAGE_BODY = "lightning.message.body"
OBJECT_JSON = "lightning.object.json"
OPERATION_NAME = "lightning.operation.name"
OPERATION_INPUT = "lightning.operation.input"
OPERATION_OUTPUT = "lightning.operation.output"

# Resource attributes that tie OpenTelemetry spans from any language to a rollout attempt.
ROLLOUT_ID = "lightning.rollout_id"
ATTEMPT_ID = "lightning.attempt_id"
SPAN_SEQUENCE_ID = "lightning.span_sequence_id"

# agent-lightning 0.3 spellings, accepted on input.
PEER_REWARD_SPAN = "agentlightning.reward"
PEER_ANNOTATION_SPAN = "agentlightning.annotation"
"""agent-lightning 0.3's `emit_reward` span: its rewards flattened into `agentlightning.reward.<i>.name` / `.value`."""
PEER_PRIMARY_REWARD = "agentlightning.reward.0.value"
"""The primary reward of an agent-lightning 0.3 reward list."""
PEER_MESSAGE_BODY = "agentlightning.message.body"
PEER_OBJECT_JSON = "agentlightning.object.json"
PEER_OBJECT_LITERAL = "agentlightning.object.literal"
PEER_OBJECT_TYPE = "agentlightning.object.type"
PEER_ROLLOUT_ID = "agentlightning.rollout_id"
PEER_ATTEMPT_ID = "agentlightning.attempt_id"
PEER_SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"


class SpanNames(StrEnum):
    """agent-lightning's enum of span names (deprecated there in favour of its semconv), with the names our spans
    have: `span.name == SpanNames.REWARD` finds our reward spans. No span here is named VIRTUAL (agl's adapters make
    such spans; ours do not)."""

    REWARD = REWARD_SPAN
    MESSAGE = MESSAGE_SPAN
    OBJECT = OBJECT_SPAN
    EXCEPTION = EXCEPTION_SPAN
    VIRTUAL = "lightning.virtual"
    ROLLOUT_ID = ROLLOUT_ID
    ATTEMPT_ID = ATTEMPT_ID
    SPAN_SEQUENCE_ID = SPAN_SEQUENCE_ID


class SpanAttributeNames(StrEnum):
    """agent-lightning's enum of the attributes its emitters wrote (deprecated there), with the attributes ours
    write: MESSAGE holds a message span's text, OBJECT an object span's JSON."""

    MESSAGE = MESSAGE_BODY
    OBJECT = OBJECT_JSON


# LLM call spans, written by the LLM proxy. They follow OpenTelemetry's GenAI conventions
# (`gen_ai.*`: span name "{operation} {model}") and add the exact token ids.
GEN_AI_OPERATION = "gen_ai.operation.name"
""""chat" for /v1/chat/completions, "text_completion" for /v1/completions."""
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
"""The request's messages (chat) or prompt (completions), as JSON text."""
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
"""One output message per choice, as JSON text: role, content, tool_calls, finish_reason."""
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"
"""The request's `tools` as sent (OpenAI's shape), as JSON text; absent when the request has none."""
GEN_AI_REQUEST_PREFIX = "gen_ai.request."
"""Sampling parameters as sent: `gen_ai.request.temperature`, `.top_p`, `.max_tokens`, `.seed`, ..."""

LLM_PROMPT_TOKEN_IDS = "lightning.llm.prompt_token_ids"
"""The prompt's token ids, encoded with `encode_token_ids`."""
LLM_RESPONSE_TOKEN_IDS = "lightning.llm.response_token_ids"
"""One encoded token-id string per choice, in choice order."""
LLM_RESPONSE_LOGPROBS = "lightning.llm.response_logprobs"
"""One encoded log-prob string per choice (`encode_logprobs`): the sampler's log-prob of each response token."""
TRIPLET_RESPONSE_LOG_PROBS = "response_log_probs"
"""A triplet's metadata key for the sampler's log-prob of each response token (the adapter writes it from the
spans; a training batch takes it when every row has it)."""
LLM_CHOICE_PROMPT_TOKEN_IDS = "lightning.llm.choice_prompt_token_ids"
"""Only for a completions call with several prompts: one encoded prompt per choice."""
LLM_BACKEND = "lightning.llm.backend"
LLM_CONTINUATION = "lightning.llm.continuation"
"""On a chat call that continues an earlier call of its attempt: "joined" when the proxy sent the earlier call's
prompt and response ids plus the new messages' ids (`lightning.chat`), else why it could not (the server then
rendered the whole conversation, and a trajectory row splits there)."""
LLM_STREAM = "lightning.llm.stream"
LLM_LATENCY_MS = "lightning.llm.latency_ms"
LLM_TIME_TO_FIRST_CHUNK_MS = "lightning.llm.time_to_first_chunk_ms"
LLM_TRIES = "lightning.llm.tries"
"""Backends tried for this call (1 when the first answered)."""
LLM_WEIGHT_VERSION = "lightning.llm.weight_version"
LLM_LORA_ADAPTER = "lightning.llm.lora_adapter"
"""On a call of a LoRA run served by vLLM: the name of the adapter the call was sent to (`<model>-lora-<step>`, loaded
for checkpoint `step`, which `lightning.llm.weight_version` records), so a trace says which adapter produced it."""
LLM_HTTP_STATUS = "http.response.status_code"


def encode_token_ids(token_ids: list[int]) -> str:
    """Token ids as base64 of little-endian uint32: a third smaller than JSON and decoded in one call."""
    return _pack("I", token_ids)


def decode_token_ids(encoded: str) -> list[int]:
    """The inverse of `encode_token_ids`."""
    return _unpack("I", encoded)


def encode_logprobs(logprobs: list[float]) -> str:
    """Log-probs as base64 of little-endian float32 (what samplers compute them in)."""
    return _pack("f", logprobs)


def decode_logprobs(encoded: str) -> list[float]:
    """The inverse of `encode_logprobs`."""
    return _unpack("f", encoded)


def _pack(typecode: str, values: list[Any]) -> str:
    """`values` as base64 of little-endian `array` items of `typecode`."""
    packed = array.array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack(typecode: str, encoded: str) -> list[Any]:
    packed = array.array(typecode)
    packed.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


REWARD_LIMIT = 1e6
"""The largest reward magnitude taken (`emit_reward` refuses more; a reward span past it reads as no reward):
past it, group statistics overflow (1e308 squared is inf) and one rollout swamps the batch."""
