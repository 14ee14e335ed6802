"""Inference servers: an embedded OpenAI-compatible server on transformers (CPU and tests)."""

from lightning.inference.engine import GenerationRecord, InferenceEngine, Output, SamplingParams
from lightning.inference.server import create_inference_app

__all__ = ["GenerationRecord", "InferenceEngine", "Output", "SamplingParams", "create_inference_app"]
