"""What Prefect costs: demo iterations run as the `training_iteration` flow (seven Prefect tasks, results
persisted, runner tasks fanned out on Prefect's thread pool) against the same stages called directly
(`lightning.stages` on an open `Run` of its own, runners on threads likewise), same config and seed. The two runs
are interleaved, iteration by iteration, so machine noise hits both alike; the first iteration of each is a warm-up
and is not counted. Prefect's temporary server starts first (not timed) unless PREFECT_API_URL names one.

    .venv/bin/python benchmarks/flow_overhead.py [--iterations 8] [--config examples/copy_task/demo.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning import stages  # noqa: E402
from lightning.config import TrainConfig, load_config  # noqa: E402
from lightning.run import Run  # noqa: E402


async def direct_iteration(run: Run, iteration: int) -> None:
    """The body of flows.train.training_iteration, without Prefect: runner tasks on threads, as Prefect's pool."""
    resources_id = await stages.update_resources(run, "train")
    rollout_ids = await stages.enqueue_rollouts(run, iteration, resources_id)
    await asyncio.gather(
        *(
            asyncio.to_thread(asyncio.run, stages.run_runners(run, rollout_ids, index))
            for index in range(run.config.n_runners)
        )
    )
    rollouts = await stages.wait_for_rollouts(run, rollout_ids)
    batch = await stages.adapt_spans(run, iteration, rollout_ids)
    metrics = await stages.ppo_step(run, iteration, batch["batch_path"])
    await stages.checkpoint(run, iteration, stages.iteration_row(iteration, rollouts, batch, metrics, 1.0))


async def measure(base: TrainConfig, iterations: int) -> dict[str, list[float]]:
    from flows.train import training_iteration

    configs = {mode: base.model_copy(update={"run_name": f"overhead-{mode}"}) for mode in ("direct", "prefect")}
    runs = {mode: await Run.open(config) for mode, config in configs.items()}
    times: dict[str, list[float]] = {"direct": [], "prefect": []}
    try:
        for iteration in range(iterations + 1):
            for mode in ("direct", "prefect") if iteration % 2 == 0 else ("prefect", "direct"):
                started = time.perf_counter()
                if mode == "direct":
                    await direct_iteration(runs[mode], iteration)
                else:
                    await training_iteration(runs[mode], iteration)
                elapsed = time.perf_counter() - started
                if iteration > 0:
                    times[mode].append(elapsed)
                print(
                    f"  iteration {iteration} {mode:8s} {elapsed:6.2f} s{'' if iteration else ' (warm-up)'}", flush=True
                )
    finally:
        for run in runs.values():
            await run.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "examples/copy_task/demo.yaml"))
    parser.add_argument("--iterations", type=int, default=8, help="timed iterations of each (after one warm-up)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="flow-overhead-"))
    base = load_config(
        args.config,
        store_url=f"sqlite:///{workdir}/store.db",
        tracking_uri=f"sqlite:///{workdir}/mlflow.db",
        output_dir=str(workdir / "runs"),
    )
    load_before = os.getloadavg()
    times = asyncio.run(_with_prefect(base, args.iterations))
    load_after = os.getloadavg()
    # Paired: iteration i as the flow minus iteration i called directly (run back to back).
    added = [prefect - direct for prefect, direct in zip(times["prefect"], times["direct"], strict=True)]
    print(
        f"\nOne demo iteration ({base.batch_size} tasks x {base.samples_per_task} samples, {base.n_runners} runner "
        f"tasks), {args.iterations} timed iterations each, interleaved; {os.cpu_count()} cores, load average "
        f"(1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("| stages run | mean s/iteration | median s/iteration |")
    print("|---|---|---|")
    for mode, label in (("direct", "called directly"), ("prefect", "as the Prefect flow")):
        print(f"| {label} | {statistics.mean(times[mode]):.3f} | {statistics.median(times[mode]):.3f} |")
    print(f"| Prefect adds (flow - direct, paired) | {statistics.mean(added):+.3f} | {statistics.median(added):+.3f} |")
    direct = statistics.median(times["direct"])
    print(f"\nPrefect adds {statistics.median(added):+.3f} s per iteration (median), "
          f"{100 * statistics.median(added) / direct:+.1f}% of the median direct iteration")  # fmt: skip


async def _with_prefect(base: TrainConfig, iterations: int) -> dict[str, Any]:
    """Run inside a flow so the subflow and its tasks report to one parent, as under `train` (which also names
    itself in the stages' cache keys)."""
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.caching import TRAIN_FLOW_RUN_ID

    @flow(name="flow-overhead")
    async def overhead() -> dict[str, list[float]]:
        TRAIN_FLOW_RUN_ID.set(str(flow_run.get_id()))
        return await measure(base, iterations)

    return await overhead()


if __name__ == "__main__":
    main()
