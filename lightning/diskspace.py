"""Free space before a checkpoint is written: a full disk fails the checkpoint stage with one line naming the
directory, the megabytes needed and free, instead of the serializer's error from the middle of a file."""

from __future__ import annotations

import shutil
from pathlib import Path

MB = 1024 * 1024
OPTIMIZER_FACTOR = 3
"""Before the first checkpoint: the weights, and Adam's two moments of the same size, in the trainer state."""


class NoSpaceLeft(OSError):
    """The checkpoint would not fit on its disk."""


def tree_bytes(path: Path) -> int:
    """The size of the files under `path` (0 when it is not there)."""
    if not path.is_dir():
        return path.stat().st_size if path.is_file() else 0
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())


def checkpoint_bytes(latest: Path | None, model_dir: Path) -> int:
    """What the next checkpoint will take: as much as the latest one, or the model and its optimizer state."""
    if latest is not None:
        return tree_bytes(latest)
    return OPTIMIZER_FACTOR * tree_bytes(model_dir)


def check_free_space(directory: Path, needed: int, reserve_mb: float = 0.0) -> None:
    """Raise NoSpaceLeft unless `directory`'s disk has `needed` bytes free beyond `reserve_mb` megabytes."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    wanted = needed + reserve_mb * MB
    if free < wanted:
        raise NoSpaceLeft(
            f"no space left on {directory}: {wanted / MB:.1f} MB needed, {free / MB:.1f} free (the checkpoint "
            f"{needed / MB:.1f} MB, checkpoint.reserve_mb {reserve_mb:g}); free space there (or lower "
            "checkpoint.keep_last), then run the same command again: the run resumes from its latest checkpoint"
        )
