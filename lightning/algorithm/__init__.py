"""RL training math and the torch trainer: triplets -> TrainingBatch -> advantages -> clipped policy loss -> update."""

from typing import Any

from lightning.agl_import_paths import missing


def __getattr__(name: str) -> Any:
    missing(__name__, name)
