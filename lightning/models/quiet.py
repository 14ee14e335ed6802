"""Silence transformers' per-call progress bars: a training run loads and saves weights every
iteration, and a bar each time buries the run's own progress lines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_disabled = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not was_disabled:
            hf_logging.enable_progress_bar()
