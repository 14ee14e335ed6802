"""Training checkpoints: a Hugging Face model directory plus trainer state, written atomically so a run resumes exactly.

Layout of one checkpoint, `<root>/step-000042/`:

    config.json, generation_config.json, model.safetensors   the model, as transformers and vLLM load it
      or adapter_config.json, adapter_model.safetensors       a LoRA adapter (peft's format), whose base model meta.json
                                                              names (`base_model`)
    tokenizer.json, tokenizer_config.json, ...               the tokenizer
    trainer_state/state.pt                                   the caller's `trainer_state` (torch.save)
    trainer_state/rng.json                                   torch, CUDA, Python and NumPy RNG states
    meta.json                                                step, save time and the caller's `meta`
    manifest.json                                            every other file's size and SHA-256, written last

A checkpoint is written into `<root>/.tmp-step-000042-<random>/`, every file fsynced, then renamed to its final
name: a `step-*` directory is complete or absent, never half written. `<root>/latest` names the newest one.
Whatever happens to it afterwards (a disk filling up, a copy cut short, a stray edit), the manifest tells:
`latest_checkpoint` passes over a checkpoint whose files do not have their recorded sizes, and
`verified_latest_checkpoint` (what a resume starts from) checks the checksums too and sets a damaged one aside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning.models.files import make_tokenizer_config_portable, no_progress_bars

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-"
LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
DAMAGED_PREFIX = "damaged-"
TRAINER_STATE = "trainer_state"
STATE_FILE = "state.pt"
RNG_FILE = "rng.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# What torch.load(weights_only=True) accepts (checked against torch 2.13); anything else fails only at resume time.
_WEIGHTS_ONLY_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_WEIGHTS_ONLY_LEAVES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.Size,
    torch.dtype,
    torch.device,
)


class CheckpointError(Exception):
    """A checkpoint directory is missing files or cannot be read."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model_dir: Path
    """The Hugging Face model directory: from_pretrained(model_dir) and vLLM load it as is. The checkpoint itself.
    For a LoRA checkpoint, peft's adapter directory: `base_model` is the model it applies to."""
    trainer_state: dict[str, Any] | None
    meta: dict[str, Any]
    rng_state: dict[str, Any] | None
    """RNG states captured when the checkpoint was saved; `restore_rng_state(ckpt.rng_state)` to continue them."""

    @property
    def base_model(self) -> Path | None:
        """The base model directory a LoRA checkpoint's adapter applies to; None for a checkpoint of whole weights."""
        base = self.meta.get("base_model")
        return None if base is None else Path(base)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter (peft's adapter_config.json) rather than whole weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base_model(path: str | Path) -> Path:
    """The base model directory an adapter directory names (its adapter_config.json's base_model_name_or_path)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise CheckpointError(
            f"adapter {path}: its base model {base!r} (adapter_config.json's base_model_name_or_path) is not a model "
            "directory here"
        )
    return Path(base)


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Write checkpoint `step` under `root` atomically, point `latest` at it, prune to `keep_last`; its path.

    `trainer_state` (optimizer and scheduler state dicts, tensors, plain values) is saved with torch.save and must
    load under torch.load(weights_only=True). `meta` must be JSON (iteration, data position, weight version, ...).
    The current RNG states are saved too. Saving a step that exists replaces it. A peft model saves its adapter, and
    meta names the base model its adapter config names (`base_model`).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = Path(root)
    peft_config = getattr(model, "peft_config", None)
    if peft_config is not None:
        base = peft_config["default"].base_model_name_or_path
        if not base or not (Path(base) / "config.json").is_file():
            raise CheckpointError(f"a LoRA checkpoint names its base model directory; the adapter names {base!r}")
        meta = {**(meta or {}), "base_model": str(base)}
    # Fail before writing anything on what would otherwise only fail at resume time.
    meta_text = json.dumps({**(meta or {}), "step": step, "saved_at": time.time()}, indent=2) + "\n"
    if trainer_state is not None:
        _check_weights_only(trainer_state, "trainer_state")
    root.mkdir(parents=True, exist_ok=True)
    _remove_temp_dirs(root)

    tmp = root / f"{TMP_PREFIX}step-{step:06d}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        with no_progress_bars():
            if peft_config is not None:
                # Only the adapters: with lm_head among the targets peft would also save the frozen head whole (as
                # "embedding layers"), which the servers already hold.
                model.save_pretrained(tmp, save_embedding_layers=False)
            else:
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        make_tokenizer_config_portable(tmp / "tokenizer_config.json")
        state_dir = tmp / TRAINER_STATE
        state_dir.mkdir()
        (state_dir / RNG_FILE).write_text(json.dumps(capture_rng_state()) + "\n")
        if trainer_state is not None:
            torch.save(trainer_state, state_dir / STATE_FILE)
        (tmp / META).write_text(meta_text)
        _write_manifest(tmp)  # last: it vouches for everything before it
        missing = _missing_files(tmp)
        if missing:
            raise CheckpointError(f"saving step {step} produced an incomplete checkpoint in {tmp}: missing {missing}")
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    final = checkpoint_dir(root, step)
    if final.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first. A crash between the two
        # renames leaves step `step` absent (the aside copy is a temp dir, removed on the next save) and the
        # checkpoints before it valid.
        aside = root / f"{TMP_PREFIX}replaced-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is whole, else the whole one with the highest step; None if none. Whole:
    every file its manifest lists is there with its recorded size (a checkpoint from before manifests: the files a
    checkpoint needs are there).

    `latest` lags the newest directory only after a crash between the two renames of a save; either is valid.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if STEP_DIR.match(named.name) and named.is_dir() and _damage(named) is None:
            return named
    for path in reversed(_step_dirs(root)):
        damage = _damage(path)
        if damage is None:
            return path
        _warn_once(f"skipping checkpoint {path}: {damage}")
    return None


def verified_latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint whose files match their manifest's sizes and checksums: what a resume starts from. A
    newer one that does not is set aside (renamed `damaged-step-...`, kept for inspection), in one logged line
    naming the file, and `latest` is pointed at the one returned."""
    root = Path(root)
    for path in reversed(_step_dirs(root)):
        damage = _damage(path, checksums=True)
        if damage is None:
            if (root / LATEST).is_file() and (root / LATEST).read_text().strip() != path.name:
                _write_latest(root, path.name)
            return path
        aside = root / f"{DAMAGED_PREFIX}{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # another process set it aside first
            continue
        logger.warning("checkpoint %s is damaged (%s); set aside as %s", path, damage, aside.name)
    if (root / LATEST).is_file():
        (root / LATEST).unlink()
    return None


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` that is missing or not what its manifest
    recorded (its size, and with `checksums` its SHA-256)."""
    damage = _damage(Path(path), checksums=checksums)
    if damage is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {damage}")


def _damage(path: Path, *, checksums: bool = False) -> str | None:
    """What is wrong with checkpoint `path`, in a few words naming the file; None if nothing."""
    missing = _missing_files(path)
    if missing:
        return f"missing {', '.join(missing)}"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None  # saved before manifests existed: the files' presence is all there is to check
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for name, recorded in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != recorded["size"]:
            return f"{name} is {size} bytes, its manifest says {recorded['size']}"
        if checksums and _sha256(file) != recorded["sha256"]:
            return f"{name} does not match the checksum its manifest recorded"
    return None


def _write_manifest(path: Path) -> None:
    files = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[file.relative_to(path).as_posix()] = {"size": file.stat().st_size, "sha256": _sha256(file)}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A damaged checkpoint is looked past on every lookup; say so once per process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read checkpoint `path` (a `step-*` directory). Tensors in trainer_state land on `map_location`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if not STEP_DIR.match(path.name) and _step_dirs(path):
        raise CheckpointError(f"{path} is a checkpoint root, not a checkpoint; pass latest_checkpoint({str(path)!r})")
    damage = _damage(path)
    if damage is not None:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {damage}")
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {META}: {exc}") from exc
    state_path = path / TRAINER_STATE / STATE_FILE
    trainer_state = None
    if state_path.exists():
        try:
            trainer_state = torch.load(state_path, map_location=map_location, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path}: cannot load {state_path.relative_to(path)}: {exc}") from exc
    rng_path = path / TRAINER_STATE / RNG_FILE
    rng_state = None
    if rng_path.exists():
        try:
            rng_state = json.loads(rng_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read {rng_path.relative_to(path)}: {exc}") from exc
    match = STEP_DIR.match(path.name)
    step = int(match.group(1)) if match else int(meta["step"])
    return Checkpoint(path, step, path, trainer_state, meta, rng_state)


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names); the deleted paths.

    Incomplete step directories older than the oldest kept one go too; newer ones are left for inspection.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    dirs = _step_dirs(root)
    complete = [p for p in dirs if _damage(p) is None]
    kept = set(complete[-keep_last:])
    latest = latest_checkpoint(root)
    if latest is not None:
        kept.add(latest)
    if not kept:
        return []
    oldest_kept = min(_step_of(p) for p in kept)
    removed = []
    for path in dirs:
        if path in kept or (path not in complete and _step_of(path) > oldest_kept):
            continue
        # Rename first so that a crash mid-delete leaves a temp dir, not a half-deleted checkpoint.
        doomed = root / f"{TMP_PREFIX}pruned-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def capture_rng_state() -> dict[str, Any]:
    """The torch (CPU and CUDA), Python `random` and global NumPy RNG states, as JSON values."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)]
    return state


def resume_trainer(trainer: Any, checkpoint: Checkpoint) -> None:
    """Continue `trainer` (built on the checkpoint's weights) where the checkpoint left off: its optimizer,
    scheduler and step count, then the RNG states saved with them (last: building a trainer draws from the RNGs).
    The next step is then the one the uninterrupted run would have taken, bit for bit on CPU."""
    if checkpoint.trainer_state is None:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no trainer state: cannot resume the optimizer")
    trainer.load_state_dict(checkpoint.trainer_state)
    if checkpoint.rng_state is not None:
        restore_rng_state(checkpoint.rng_state)


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNGs that `capture_rng_state` captured back to those states."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))  # type: ignore[union-attr]


def _step_dirs(root: Path) -> list[Path]:
    """The `step-*` directories under root, oldest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=_step_of)


def _missing_files(path: Path) -> list[str]:
    """What a complete checkpoint has that `path` lacks: an empty list if it is complete."""
    if (path / ADAPTER_CONFIG).is_file():
        required = (ADAPTER_WEIGHTS, "tokenizer_config.json", META, TRAINER_STATE)
        return [name if name != TRAINER_STATE else f"{name}/" for name in required if not (path / name).exists()]
    missing = [name for name in ("config.json", "tokenizer_config.json", META) if not (path / name).is_file()]
    if not (path / TRAINER_STATE).is_dir():
        missing.append(f"{TRAINER_STATE}/")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError):
            return [*missing, f"a readable {index.name}"]
        missing += [shard for shard in shards if not (path / shard).is_file()]
    elif not (path / "model.safetensors").is_file():
        missing.append("model.safetensors")
    return missing


def _check_weights_only(obj: Any, where: str) -> None:
    """Raise TypeError naming the first value in `obj` that torch.load(weights_only=True) would refuse."""
    if isinstance(obj, torch.Tensor) or type(obj) in _WEIGHTS_ONLY_LEAVES:
        return
    if type(obj) not in _WEIGHTS_ONLY_CONTAINERS:
        raise TypeError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True) "
            "refuses; store it as a tensor or plain values (RNG states are saved for you: see capture_rng_state)"
        )
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_weights_only(key, f"{where} key {key!r}")
            _check_weights_only(value, f"{where}[{key!r}]")
    else:
        for i, value in enumerate(obj):
            _check_weights_only(value, f"{where}[{i}]")


def _remove_temp_dirs(root: Path) -> None:
    """Remove what crashed saves and prunes left behind."""
    for path in root.iterdir():
        if not path.name.startswith(TMP_PREFIX):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
