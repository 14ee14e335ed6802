"""The multi-turn example (examples/lookup) trained over seeds and adapter shapes, as `make lookup` trains it: the
held-out reward after the warm start and after RL, the share of training rollouts that called the tool in the first
and the last iteration, LLM calls (turns) a rollout, trajectory splits, and the wall time of each run.

    .venv/bin/python benchmarks/multi_turn_bench.py --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/multi_turn_bench.py --seeds 0 1 2 --shapes trajectory transition

Each run is a `python -m flows.train examples/lookup/train.yaml` of its own (store, MLflow and run files in a
temporary directory), one after the other; `--set` passes more overrides to every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402

CONFIG = "examples/lookup/train.yaml"


def train(seed: int, shape: str, sets: list[str], root: Path) -> dict[str, Any]:
    overrides = [
        f"run_name=lookup-{shape}-{seed}", f"seed={seed}", f"algorithm.seed={seed}", f"adapter_shape={shape}",
        f"store_url=sqlite:///{root}/store.db", f"tracking_uri=sqlite:///{root}/mlflow.db", f"output_dir={root}/runs",
        *sets,
    ]  # fmt: skip
    command = [sys.executable, "-m", "flows.train", CONFIG]
    for override in overrides:
        command += ["--set", override]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} ({shape}) failed:\n{done.stderr[-3000:]}")
    summary = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{") :])[0]
    history = load_checkpoint(latest_checkpoint(root / "runs" / f"lookup-{shape}-{seed}" / "checkpoints")).meta[
        "history"
    ]
    return {
        "seed": seed, "shape": shape, "warm_start": summary["reward_before"], "after_rl": summary["reward_after"],
        "tool_use_first": history[0].get("tool_use", 0.0), "tool_use_last": history[-1].get("tool_use", 0.0),
        "turns_last": history[-1].get("turns", 1.0), "splits": sum(row.get("trajectory_splits", 0) for row in history),
        "minutes": seconds / 60,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--shapes", nargs="+", default=["trajectory"], choices=["trajectory", "transition"])
    parser.add_argument("--set", action="append", default=[], help="another override for every run (dotted=value)")
    args = parser.parse_args()
    rows = []
    print("| shape | seed | held-out after warm start | after RL | tool use, first -> last iteration | turns | splits "
          "| minutes |\n|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    for shape in args.shapes:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory(prefix="multi-turn-") as root:
                row = train(seed, shape, args.set, Path(root))
            rows.append(row)
            print(
                f"| {shape} | {seed} | {row['warm_start']:.3f} | {row['after_rl']:.3f} | "
                f"{row['tool_use_first']:.0%} -> {row['tool_use_last']:.0%} | {row['turns_last']:.2f} | "
                f"{row['splits']} | {row['minutes']:.1f} |",
                flush=True,
            )
    for shape in args.shapes:
        mine = [row for row in rows if row["shape"] == shape]
        after = [row["after_rl"] for row in mine]
        gained = sum(row["after_rl"] >= 0.9 and row["after_rl"] - row["warm_start"] >= 0.2 for row in mine)
        print(
            f"{shape}: held-out after RL median {statistics.median(after):.3f} (min {min(after):.3f}, max "
            f"{max(after):.3f}); {gained} of {len(mine)} seeds reach 0.9 and gain 0.2 over their warm start; median "
            f"{statistics.median(row['minutes'] for row in mine):.1f} minutes a run"
        )


if __name__ == "__main__":
    main()
