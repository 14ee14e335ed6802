"""What Prefect costs: demo iterations run as the `training_iteration` flow (seven Prefect tasks, results
persisted, runner tasks fanned out on Prefect's thread pool) against the same stages called directly
(`lightning.stages` on an open `Run` of its own, runners on threads likewise), same config and seed. The two runs
are interleaved, iteration by iteration, so machine noise hits both alike; the first iteration of each is a warm-up
and is not counted. Prefect's temporary server starts first (not timed) unless PREFECT_API_URL names one.

Besides wall time, each iteration's time outside the stages is measured: the wall time less the time some
`lightning.stages` call of the iteration was running (the seven are wrapped with a timer). Called directly that is
about nothing; as the flow it is what Prefect adds in between (task runs, the subflow, the fan-out), a figure the
stages' own noise (a PPO step on a busy machine varies by seconds) does not swamp.

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

from lightning import reporting, stages  # noqa: E402
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
    await stages.checkpoint(run, iteration, reporting.iteration_row(iteration, rollouts, batch, metrics, 1.0))


STAGES = ("update_resources", "enqueue_rollouts", "run_runners", "wait_for_rollouts", "adapt_spans", "ppo_step",
          "checkpoint")  # fmt: skip
_inside: list[tuple[float, float]] = []
"""(start, end) of every call of STAGES, from any thread (the runners run on threads)."""


def _time_stages() -> None:
    """Wrap STAGES in `lightning.stages` with a timer; both modes call them through the module, the tasks too."""
    for name in STAGES:

        async def timed_stage(*args: Any, _call: Any = getattr(stages, name), **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await _call(*args, **kwargs)
            finally:
                _inside.append((started, time.perf_counter()))

        setattr(stages, name, timed_stage)


def _outside(started: float, ended: float) -> float:
    """Seconds of [started, ended] during which no stage ran: the length less the union of the stages' intervals."""
    busy, reach = 0.0, started
    for begin, end in sorted(_inside):
        begin, end = max(begin, reach), min(end, ended)
        if end > begin:
            busy += end - begin
            reach = end
    return (ended - started) - busy


async def measure(base: TrainConfig, iterations: int) -> dict[str, list[float]]:
    from flows.train import training_iteration

    _time_stages()
    configs = {mode: base.model_copy(update={"run_name": f"overhead-{mode}"}) for mode in ("direct", "prefect")}
    runs = {mode: await Run.open(config) for mode, config in configs.items()}
    times: dict[str, list[float]] = {"direct": [], "prefect": [], "direct outside": [], "prefect outside": []}
    try:
        for iteration in range(iterations + 1):
            for mode in ("direct", "prefect") if iteration % 2 == 0 else ("prefect", "direct"):
                _inside.clear()
                started = time.perf_counter()
                if mode == "direct":
                    await direct_iteration(runs[mode], iteration)
                else:
                    await training_iteration(runs[mode], iteration)
                ended = time.perf_counter()
                outside = _outside(started, ended)
                if iteration > 0:
                    times[mode].append(ended - started)
                    times[f"{mode} outside"].append(outside)
                print(
                    f"  iteration {iteration} {mode:8s} {ended - started:6.2f} s, {outside:5.3f} s outside the stages"
                    f"{'' if iteration else ' (warm-up)'}",
                    flush=True,
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
    print("| stages run | mean s/iteration | median s/iteration | median s outside the stages |")
    print("|---|---|---|---|")
    for mode, label in (("direct", "called directly"), ("prefect", "as the Prefect flow")):
        print(
            f"| {label} | {statistics.mean(times[mode]):.3f} | {statistics.median(times[mode]):.3f} "
            f"| {statistics.median(times[f'{mode} outside']):.3f} |"
        )
    direct = statistics.median(times["direct"])
    fixed = statistics.median(times["prefect outside"]) - statistics.median(times["direct outside"])
    print(f"| Prefect adds (flow - direct, paired) | {statistics.mean(added):+.3f} | {statistics.median(added):+.3f} "
          f"| {fixed:+.3f} |")  # fmt: skip
    print(f"\nPrefect's fixed cost (time outside the stages, flow - direct, medians): {fixed:.3f} s per iteration, "
          f"{100 * fixed / direct:.1f}% of the median direct iteration ({direct:.3f} s)")  # fmt: skip


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
