"""Same seed, same run? The demo's config run twice with one seed, with `deterministic` off and on: how far the two
runs drift apart (per-iteration reward, held-out reward, final weights) and what determinism costs in wall time.

    .venv/bin/python benchmarks/determinism.py [--iterations 10] [--set batch_size=16 ...]

Each run is `python -m flows.train examples/copy_task/demo.yaml` in a fresh directory (its own store, MLflow and
Prefect's temporary server), so the runs share nothing but the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning.checkpoint import latest_checkpoint  # noqa: E402
from lightning.config import load_config  # noqa: E402
from lightning.run import recorded_history  # noqa: E402


def train(root: Path, deterministic: bool, iterations: int, extra: list[str]) -> dict[str, Any]:
    """One demo run under `root`; its history, held-out rewards, final weights and wall time."""
    sets = {
        "iterations": iterations, "deterministic": deterministic, "eval_every": 0, "checkpoint.register_model": None,
        "run_name": "det", "store_url": f"sqlite:///{root}/store.db", "tracking_uri": f"sqlite:///{root}/mlflow.db",
        "output_dir": str(root / "runs"),
    }  # fmt: skip
    args = [arg for name, value in sets.items() for arg in ("--set", f"{name}={json.dumps(value)}")]
    args += [arg for item in extra for arg in ("--set", item)]
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "flows.train", "examples/copy_task/demo.yaml", *args],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    config = load_config(REPO / "examples/copy_task/demo.yaml", **{k: v for k, v in sets.items()})
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    final = latest_checkpoint(config.run_dir / "checkpoints")
    client = MlflowClient(config.tracking_uri)
    (run,) = client.search_runs(client.get_experiment_by_name(config.experiment).experiment_id)
    held_out = client.get_metric_history(run.info.run_id, "val.reward_mean")
    return {
        "rewards": [row["reward"] for row in recorded_history(config)],
        "held_out": max(held_out, key=lambda metric: metric.step).value,
        "weights": load_file(str(final / "model.safetensors")),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="more overrides of the demo's config")
    args = parser.parse_args()
    load = MachineLoad()
    rows = []
    with tempfile.TemporaryDirectory(prefix="determinism-") as tmp:
        for deterministic in (False, True):
            first, second = (
                train(Path(tmp) / f"{deterministic}-{n}", deterministic, args.iterations, args.set) for n in (1, 2)
            )
            reward_gap = max(abs(a - b) for a, b in zip(first["rewards"], second["rewards"], strict=True))
            weight_gap = max(float((first["weights"][k] - second["weights"][k]).abs().max()) for k in first["weights"])
            rows.append(
                (
                    deterministic, first["rewards"] == second["rewards"], reward_gap,
                    abs(first["held_out"] - second["held_out"]), weight_gap,
                    (first["seconds"] + second["seconds"]) / 2,
                )
            )  # fmt: skip
    print(f"\nThe demo's config, {args.iterations} iterations, seed 0, run twice per setting")
    print("| deterministic | same rewards | largest reward gap | held-out gap | largest weight gap | s per run |")
    print("|---|---|---|---|---|---|")
    for det, same, reward_gap, held_gap, weight_gap, seconds in rows:
        print(f"| {det} | {same} | {reward_gap:.4f} | {held_gap:.4f} | {weight_gap:.2e} | {seconds:.0f} |")
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
