"""A checkpoint as a whole Hugging Face model directory: a LoRA checkpoint's adapter merged into its base model (what
`lightning export` writes and what a LoRA run registers in MLflow), a whole-weights checkpoint's model files copied."""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning.checkpoint import CheckpointError, adapter_base_model, is_adapter_dir
from lightning.models.files import make_tokenizer_config_portable, no_progress_bars

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
"""What a whole-weights checkpoint's model is, beside its tokenizer files (the trainer state is left out)."""


def export_model(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write checkpoint `checkpoint`'s model to `out_dir` (which must not exist or be empty) as a whole Hugging Face
    model directory that transformers and vLLM load as is: an adapter merged into its base (peft's
    `merge_and_unload`, float32), whole weights copied; the tokenizer with it. `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{checkpoint} is not a checkpoint (no tokenizer_config.json)")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; give a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not is_adapter_dir(checkpoint):
        for file in checkpoint.iterdir():
            if file.is_file() and (file.name in MODEL_FILES or file.name.startswith("model-") or "token" in file.name):
                shutil.copy2(file, out_dir / file.name)
        return out_dir
    from peft import PeftModel

    with no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(adapter_base_model(checkpoint), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
        merged.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out_dir)
    make_tokenizer_config_portable(out_dir / "tokenizer_config.json")
    return out_dir
