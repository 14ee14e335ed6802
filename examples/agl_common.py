"""What the two agent-lightning-style examples with a `train.py` (agl_room_selector, agl_sql_agent) share: their
tasks as JSON lines, and the small run of the tiny local model that checks their plumbing from the command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as agl
from lightning.config_file import apply_overrides, parse_overrides

TINY_RUN: dict[str, Any] = {
    "model": "tiny",
    "iterations": 3,
    "batch_size": 8,
    "samples_per_task": 4,
    "sampling": {"temperature": 1.0, "max_tokens": 96},
    "eval_sampling": {"temperature": 0.0, "max_tokens": 96},
    "max_response_length": 96,
}
"""TrainConfig fields of a three-iteration run on the tiny local model: it checks the plumbing, it learns nothing."""


def jsonl_tasks(path: Path) -> list[dict[str, Any]]:
    """A JSON object per non-blank line."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_main(train: Callable[..., dict[str, Any]], defaults: dict[str, Any], argv: list[str] | None) -> None:
    """`python -m examples.<name>.train field=value ...`: `defaults` with the command line's TrainConfig fields
    (dotted for nested ones) over them, trained, and the result printed as JSON."""
    agl.setup_logging()
    config = apply_overrides(defaults, parse_overrides(sys.argv[1:] if argv is None else argv))
    print(json.dumps(train(**config), indent=2, default=str))
