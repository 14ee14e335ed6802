"""The LLM proxy: forwards agents' calls to the inference servers and stores each call, with its
exact token ids, as a span of the rollout attempt that made it."""

from lightning.proxy.app import Backend, LLMProxy, error_response
from lightning.proxy.external import ExternalModel

__all__ = ["Backend", "ExternalModel", "LLMProxy", "error_response"]
