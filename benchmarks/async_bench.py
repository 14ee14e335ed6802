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

"cores busy" is the CPU time of this process and its children (the inference server, the proxy, Prefect's
temporary server) over the same window, divided by the window and the machine's cores: overlapping stages cannot
make a loop faster than the CPU it needs allows, so 1 / (the synchronous loop's cores busy) bounds the speed-up
that max_staleness can give on this machine (the "ceiling" column).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning.config import load_config  # noqa: E402
from lightning.config_file import parse_overrides  # noqa: E402


class CpuSampler:
    """Every `interval` s, (wall-clock time, CPU seconds of this process and its living children), on a thread."""

    def __init__(self, interval: float = 1.0) -> None:
        import psutil

        self.process, self.interval = psutil.Process(), interval
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="cpu-sampler", daemon=True)

    def cpu_seconds(self) -> float:
        import psutil

        total = 0.0
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.Error:  # it ended between the listing and the read
                continue
            total += times.user + times.system
        return total

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), self.cpu_seconds()))
            self.stop.wait(self.interval)

    def busy(self, start: float, end: float) -> float:
        """Cores busy on average between two wall-clock times (s), from the samples nearest inside them."""
        inside = [(t, cpu) for t, cpu in self.samples if start <= t <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, cpu0), (t1, cpu1) = inside[0], inside[-1]
        return (cpu1 - cpu0) / (t1 - t0) / (os.cpu_count() or 1)


async def one_run(recipe: Path, root: Path, staleness: int, seed: int, iterations: int, sets: dict[str, Any]) -> dict:
    from mlflow.tracking import MlflowClient

    from flows.train import train

    name = f"async-k{staleness}-seed{seed}"
    config = load_config(
        recipe,
        **{
            "run_name": name, "iterations": iterations, "seed": seed, "algorithm.max_staleness": staleness,
            "store_url": f"sqlite:///{root}/{name}.db", "tracking_uri": f"sqlite:///{root}/mlflow.db",
            "output_dir": str(root / "runs"), "checkpoint.register_model": None, **sets,
        },
    )  # fmt: skip
    sampler = CpuSampler()
    sampler.thread.start()
    started = time.perf_counter()
    try:
        summary = await train(config)
    finally:
        sampler.stop.set()
        sampler.thread.join()
    wall = time.perf_counter() - started
    history = MlflowClient(config.tracking_uri).get_metric_history(summary["mlflow_run_id"], "reward")
    stamps = sorted(metric.timestamp for metric in history)
    rate = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1000) if len(stamps) > 1 else float("nan")
    busy = sampler.busy(stamps[0] / 1000, stamps[-1] / 1000) if len(stamps) > 1 else float("nan")
    return {"staleness": staleness, "seed": seed, "iterations_per_s": rate, "wall_s": wall, "cores_busy": busy,
            "heldout_after": summary["reward_after"], "heldout_before": summary["reward_before"]}  # fmt: skip


def table(results: list[dict[str, Any]], staleness: list[int]) -> str:
    base = {r["seed"]: r["iterations_per_s"] for r in results if r["staleness"] == staleness[0]}
    lines = ["| max_staleness | seed | iterations/s | speed-up | cores busy | ceiling | held-out reward at the end "
             "| wall s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        speedup = r["iterations_per_s"] / base[r["seed"]] if r["seed"] in base else float("nan")
        ceiling = f"{1 / r['cores_busy']:.2f}x" if r["staleness"] == staleness[0] and r["cores_busy"] > 0 else ""
        lines.append(
            f"| {r['staleness']} | {r['seed']} | {r['iterations_per_s']:.3f} | {speedup:.2f}x | "
            f"{r['cores_busy']:.0%} | {ceiling} | {r['heldout_after']:.3f} | {r['wall_s']:.0f} |"
        )
    for k in staleness:
        mine = [r for r in results if r["staleness"] == k]
        rate = statistics.median(r["iterations_per_s"] for r in mine)
        speedups = [r["iterations_per_s"] / base[r["seed"]] for r in mine if r["seed"] in base]
        busy = statistics.median(r["cores_busy"] for r in mine)
        lines.append(
            f"| {k} | median | {rate:.3f} | {statistics.median(speedups):.2f}x | {busy:.0%} | | "
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
    sets = parse_overrides(args.set)
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
