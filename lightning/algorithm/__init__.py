"""RL training math and the torch trainer: triplets -> TrainingBatch -> advantages -> clipped policy loss -> update.
As agl's `agentlightning.algorithm`, it also offers agl's algorithm objects (`VERL`, `APO`, `Algorithm`, `algo`,
`FastAlgorithm`, `Baseline`) from
lightning.agl_algorithms, loaded on first use."""

import importlib
from typing import Any

from lightning.agl_import_paths import missing

AGL_NAMES = frozenset({"APO", "VERL", "Algorithm", "FunctionalAlgorithm", "algo", "FastAlgorithm", "Baseline"})


def __getattr__(name: str) -> Any:
    if name in AGL_NAMES:
        return getattr(importlib.import_module("lightning.agl_algorithms"), name)
    missing(__name__, name)
