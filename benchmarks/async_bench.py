"""Asynchronous RL, measured: the demo (examples/copy_task/demo.yaml) through the `train` flow with
`algorithm.max_staleness` 0 (the synchronous loop) and 1 (iteration i+1's rollouts run while iteration i adapts,
updates and checkpoints), side by side in one process, taking turns per seed; prints iterations per second, the
speed-up over max_staleness 0, and the held-out reward at the end.

    .venv/bin/python benchmarks/async_bench.py [--iterations 30] [--seeds 0 1 2] [--staleness 0 1]
        [--set algorithm.off_policy_correction=tis]

Iterations per second are counted from the end of each run's first iteration to the end of its last (MLflow's
timestamps of the `reward` metric), so start-up, the warm start and the first iteration's compilation are out, the
evaluation every `eval_every` iterations is in (the asynchronous loop drains before each). Prefect runs on its
temporary local server, as `python -m flows.train` does without PREFECT_API_URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def one_run(recipe: Path, root: Path, staleness: int, seed: int, iterations: int, sets: dict[str, Any]) -> dict:
    from mlflow.tracking import MlflowClient

    from flows.train import train
    from lightning.config import load_config

    name = f"async-k{staleness}-seed{seed}"
    config = load_config(
        recipe,
        **{
            "run_name": name, "iterations": iterations, "seed": seed, "algorithm.max_staleness": staleness,
            "store_url": f"sqlite:///{root}/{name}.db", "tracking_uri": f"sqlite:///{root}/mlflow.db",
            "output_dir": str(root / "runs"), "checkpoint.register_model": None, **sets,
        },
    )  # fmt: skip
    started = time.perf_counter()
    summary = await train(config)
    wall = time.perf_counter() - started
    history = MlflowClient(config.tracking_uri).get_metric_history(summary["mlflow_run_id"], "reward")
    stamps = sorted(metric.timestamp for metric in history)
    rate = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1000) if len(stamps) > 1 else float("nan")
    return {"staleness": staleness, "seed": seed, "iterations_per_s": rate, "wall_s": wall,
            "heldout_after": summary["reward_after"], "heldout_before": summary["reward_before"]}  # fmt: skip


def table(results: list[dict[str, Any]], staleness: list[int]) -> str:
    base = {r["seed"]: r["iterations_per_s"] for r in results if r["staleness"] == staleness[0]}
    lines = ["| max_staleness | seed | iterations/s | speed-up | held-out reward at the end | wall s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        speedup = r["iterations_per_s"] / base[r["seed"]] if r["seed"] in base else float("nan")
        lines.append(
            f"| {r['staleness']} | {r['seed']} | {r['iterations_per_s']:.3f} | {speedup:.2f}x | "
            f"{r['heldout_after']:.3f} | {r['wall_s']:.0f} |"
        )
    for k in staleness:
        mine = [r for r in results if r["staleness"] == k]
        rate = statistics.median(r["iterations_per_s"] for r in mine)
        speedups = [r["iterations_per_s"] / base[r["seed"]] for r in mine if r["seed"] in base]
        lines.append(
            f"| {k} | median | {rate:.3f} | {statistics.median(speedups):.2f}x | "
            f"{statistics.median(r['heldout_after'] for r in mine):.3f} | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "examples/copy_task/demo.yaml")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="the first is the baseline")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a recipe field")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    sets = {field: parse_value(value) for field, value in (item.split("=", 1) for item in args.set)}
    results = []
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for seed in args.seeds:
            for staleness in args.staleness:  # taking turns: a change in the machine's load hits both alike
                result = asyncio.run(one_run(args.recipe, Path(tmp), staleness, seed, args.iterations, sets))
                print(json.dumps(result), flush=True)
                results.append(result)
    print(table(results, args.staleness), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
