"""Model builders: a tiny random-weight causal LM for tests and CPU dry runs."""

from lightning.models.tiny import build_tiny_model

__all__ = ["build_tiny_model"]
