"""benchmarks/gpu_check.py's own logic, on a CPU: which carried wheels it installs, and how it reads issue 28's
targets off the update part's results. (The check itself runs on a GPU machine: `make gpu-check`; `make gpu-check
SMALL=1` is its dry run on a CPU.)"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks import gpu_check


def test_a_carried_wheel_is_installed_only_where_the_machine_lacks_it_or_has_it_older() -> None:
    assert gpu_check.needed(Path("surely_not_installed_here-1.0-py3-none-any.whl"))
    assert not gpu_check.needed(Path("pydantic-2.0.0-py3-none-any.whl"))  # this venv's is newer
    assert gpu_check.needed(Path("pydantic-999.0.0-py3-none-any.whl"))


def test_the_targets_read_off_the_update_results_by_hand() -> None:
    def row(variant: str, step_s: float, mfu: float | None = None, peak_gib: float | None = None) -> dict:
        return {"variant": variant, "step_s": step_s, "mfu": mfu, "peak_gib": peak_gib}

    update = {
        "results": [
            row("plain", 0.8),
            row("lean", 0.64, mfu=0.30, peak_gib=14.0),  # 1.25x plain; MFU short of 35%
            row("lean-kl", 0.896),  # 1.4x lean
            {"variant": "lean-ckpt", "error": "out of memory"},
        ]
    }
    assert gpu_check.targets(update) == [
        "- lean vs plain: 1.25x the plain step's speed (target >= 1.0): met",
        "- lean MFU 30.0% (target >= 35%): MISSED",
        "- lean peak 14.0 GiB (target <= 16): met",
        "- lean-kl / lean: 1.40x (target <= 1.3): MISSED",
    ]
    assert gpu_check.targets({}) == ["- not measured (the update part left no results)"]


@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
def test_every_part_command_is_one_its_script_takes(small: bool) -> None:
    """A part's arguments that its benchmark no longer takes fail only on the GPU machine, after minutes: here, each
    command of FULL and SMALL must parse under its script's own `arguments()`."""
    for name, (_, command) in (gpu_check.SMALL if small else gpu_check.FULL).items():
        script = importlib.import_module(f"benchmarks.{Path(command[0]).stem}")
        try:
            args = script.arguments().parse_args([*command[1:], "--json", "part.json"])
        except SystemExit:  # argparse has printed which argument
            pytest.fail(f"gpu_check's {name} part: {command[0]} does not take {command[1:]}")
        if "variants" in vars(args):
            assert set(args.variants.split(",")) <= set(script.VARIANTS), name
