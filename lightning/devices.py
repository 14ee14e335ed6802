"""Where the trainer and the embedded inference server run, and in which dtype the server holds its weights: the
`algorithm.device`, `inference.device` and `inference.dtype` settings resolved against what torch sees."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator

from lightning.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICE_SETTING = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEVICE_HELP = "give auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N"


def _device_setting(value: str) -> str:
    if not DEVICE_SETTING.match(value):
        raise ValueError(DEVICE_HELP)
    return value


DeviceSetting = Annotated[str, AfterValidator(_device_setting)]
"""A config field naming a device (checked by form here, against the machine by `resolve_device`)."""


def resolve_device(setting: str | None, field: str) -> torch.device:
    """The device a setting names; `auto` (or None): cuda when torch sees a GPU, else cpu. A GPU asked for where
    torch sees none raises ConfigError naming `field` and the fix."""
    import torch

    setting = setting or "auto"
    if not DEVICE_SETTING.match(setting):
        raise ConfigError(f"{field}: {setting!r} is not a device; {DEVICE_HELP}")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{field}: {setting} asked for, but torch sees no GPU here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); set {field}: cpu, or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{field}: {setting} asked for, but torch sees {torch.cuda.device_count()} GPU(s); give cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}, or auto"
            )
    return device


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: how settings and logs name a dtype."""
    return str(dtype).removeprefix("torch.")


def serving_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype the embedded server holds its weights in: `auto` is bfloat16 on a GPU that has it (half the memory
    and twice the matmul speed of float32; the trainer computes its forward in bf16 there too) and float32
    elsewhere (bf16 matmuls are slow on CPUs, and their log-probs too coarse to compare with the trainer's)."""
    import torch

    if setting == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, setting)
