"""LoRA adapters merged into the weights an inference engine holds: W = W_base + scaling * B @ A, what peft's
`merge_and_unload` computes, applied in place so that the next adapter starts again from W_base."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS

PEFT_PREFIX = "base_model.model."


def lora_scaling(config: dict) -> float:
    """alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA (peft's `use_rslora`)."""
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapter_factors(adapter_dir: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Each adapted linear layer's (B, A, scaling), by the name of the base model's weight it adds to
    (`model.layers.0.self_attn.q_proj.weight`). Only plain LoRA (what the trainer saves): DoRA, per-layer rank or alpha
    patterns and transposed (Conv1D) layers are refused rather than merged wrong."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    unsupported = [
        name
        for name in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")
        if config.get(name)
    ]
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise ValueError(f"adapter {adapter_dir}: only plain LoRA adapters are served here (it sets {unsupported})")
    scaling = lora_scaling(config)
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    # An adapted embedding (lora_embedding_A/B: `embed_tokens` in target_modules) or DoRA's magnitudes would be left
    # out of the merge without a word: refused, with what to target instead.
    other = sorted(key for key in weights if "lora_" in key and not key.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:
        raise ValueError(
            f"adapter {adapter_dir}: only adapters on linear layers are served here, not {other[:2]} "
            "(leave embedding layers out of algorithm.lora.target_modules)"
        )
    factors = {}
    for key, lora_a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(PEFT_PREFIX)
        lora_b = weights[key.replace(".lora_A.", ".lora_B.")]
        factors[f"{module}.weight"] = (lora_b.float(), lora_a.float(), scaling)
    if not factors:
        raise ValueError(f"adapter {adapter_dir}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return factors


class AdapterSlot:
    """The base weights of the layers adapters change, kept aside (on the CPU) from the first adapter on, so that each
    adapter merges into the base and not into the adapter before it."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def keep_base(self, model: torch.nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Copy aside the base weights of the layers these factors change that no adapter changed yet: `model` still
        holds them. Reads the model; changes nothing in it."""
        parameters = dict(model.named_parameters())
        unknown = sorted(set(factors) - set(parameters))
        if unknown:
            raise ValueError(f"the adapter changes weights the served model does not have: {unknown[:3]}")
        for name in factors:
            if name not in self.base:
                self.base[name] = parameters[name].detach().to("cpu", copy=True)

    @torch.no_grad()
    def apply(self, model: torch.nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Set each kept layer of `model` to its base plus scaling * B @ A (the base alone for a layer these factors
        leave alone), in place: no second copy of the weights. `keep_base` first."""
        parameters = dict(model.named_parameters())
        for name, base in self.base.items():
            parameter = parameters[name]
            if name not in factors:
                parameter.copy_(base)
                continue
            lora_b, lora_a, scaling = (t.to(parameter.device) if torch.is_tensor(t) else t for t in factors[name])
            if parameter.dtype == torch.float32:
                parameter.copy_(base).addmm_(lora_b, lora_a, alpha=scaling)
            else:  # the sum in float32, rounded once to the served dtype
                parameter.copy_(torch.addmm(base.to(parameter.device, torch.float32), lora_b, lora_a, alpha=scaling))

    def reset(self) -> None:
        """Another base model is served: what was kept aside is not its."""
        self.base.clear()
