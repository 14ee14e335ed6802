"""Names of our spans and attributes, in one place. Spans named by agent-lightning 0.3
(`agentlightning.*`) are read too, so traces from agents written for it still count."""

REWARD_SPAN = "lightning.reward"
MESSAGE_SPAN = "lightning.message"
OBJECT_SPAN = "lightning.object"
EXCEPTION_SPAN = "lightning.exception"
OPERATION_SPAN = "lightning.operation"

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
PEER_ROLLOUT_ID = "agentlightning.rollout_id"
PEER_ATTEMPT_ID = "agentlightning.attempt_id"
PEER_SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"
