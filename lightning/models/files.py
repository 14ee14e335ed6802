"""Helpers for the Hugging Face directories we write: without transformers' progress bars, and with a
tokenizer config that older transformers (which vLLM may pin) reads too."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """A training run loads and saves weights every iteration; a bar each time buries its own progress lines."""
    from transformers.utils import logging as hf_logging

    was_disabled = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not was_disabled:
            hf_logging.enable_progress_bar()


def make_tokenizer_config_portable(config_path: Path) -> None:
    """Rewrite transformers 5's tokenizer_config.json in the form transformers 4 reads too (vLLM may pin 4.x)."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    changed = False
    # "TokenizersBackend" and a list-valued "extra_special_tokens" are transformers 5 only; both versions read these.
    if config.get("tokenizer_class") == "TokenizersBackend" and (config_path.parent / "tokenizer.json").is_file():
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        changed = True
    if isinstance(config.get("extra_special_tokens"), list):
        extra = config.pop("extra_special_tokens")
        config.setdefault("additional_special_tokens", extra)
        changed = True
    if changed:
        config_path.write_text(json.dumps(config, indent=2) + "\n")
