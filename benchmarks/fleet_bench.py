"""The runner's own CPU a rollout, without an LLM (issue 39): a runner task's fleet (`run_fleet_until`, as a runner
process runs it: its own watched event loop, the store's transaction thread, the tracer) of `--concurrency` runners on
a SQLite file store, running rounds of `--rollouts` rollouts of an agent that waits 2 ms and returns a reward (one
reward span a rollout, through the tracer, as the demo agent's). What a runner process spends beside its agents'
LLM calls: the claims, each attempt's trace context and reward span, `finish_attempt`, the wait for the round.

Printed: the process's CPU (all threads, /proc) a rollout per round, median and least of the rounds after the first;
then the store thread's CPU by transaction kind, a rollout (each store call timed on its thread, `time.thread_time`),
and how many calls each kind took. Compare two versions of the code in one sitting, taking turns: absolute times on
a shared machine drift by a third between runs.

    .venv/bin/python benchmarks/fleet_bench.py [--rounds 8] [--rollouts 768] [--concurrency 128]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning.agent import rollout  # noqa: E402
from lightning.runner.fleet import run_fleet_until  # noqa: E402
from lightning.serving import freeze_startup_objects  # noqa: E402
from lightning.store import SqlLightningStore  # noqa: E402
from lightning.store import sql as sql_store  # noqa: E402
from lightning.types import RolloutConfig  # noqa: E402


@rollout
async def waiting_agent(task: dict[str, Any]) -> float:
    await asyncio.sleep(0.002)
    return 1.0


class StoreClock:
    """The store thread's CPU by transaction function: each `_run` job timed where it runs."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.counting = False

    def install(self) -> None:
        run = sql_store.SqlLightningStore._run
        clock = self

        def timed(fn: Any) -> Any:
            def call(tx: Any, *args: Any) -> Any:
                started = time.thread_time()
                try:
                    return fn(tx, *args)
                finally:
                    if clock.counting:
                        clock.seconds[fn.__name__] += time.thread_time() - started
                        clock.calls[fn.__name__] += 1

            return call

        async def timed_run(self: Any, fn: Any, *args: Any, write: bool = True) -> Any:
            return await run(self, timed(fn), *args, write=write)

        sql_store.SqlLightningStore._run = timed_run  # type: ignore[method-assign]


async def measure(args: argparse.Namespace, clock: StoreClock) -> list[float]:
    freeze_startup_objects()  # as a runner process does: each fleet ends with a full collection
    config = RolloutConfig(timeout_seconds=300, unresponsive_seconds=60, max_attempts=2, retry_condition=["timeout"])
    per_round = []
    with tempfile.TemporaryDirectory() as workdir:
        store = SqlLightningStore(f"sqlite:///{workdir}/store.db", watchdog_interval=None)
        try:
            for index in range(args.rounds + 1):
                tasks = [{"input": {"i": i}, "config": config, "queue": "q"} for i in range(args.rollouts)]
                ids = [r.rollout_id for r in await store.enqueue_many_rollouts(tasks)]
                clock.counting = index > 0
                started = time.process_time()
                result = await run_fleet_until(
                    waiting_agent, store, ids, queue="q", concurrency=args.concurrency, index=0, timeout=300,
                    blocked_after=30, on_rollout_end=lambda: None,
                )  # fmt: skip
                cpu = time.process_time() - started
                clock.counting = False
                assert result["finished"] == args.rollouts, result
                label = "warm-up" if index == 0 else f"round {index}"
                print(f"{label}: {cpu / args.rollouts * 1e6:.0f} us of CPU a rollout", flush=True)
                if index > 0:
                    per_round.append(cpu / args.rollouts * 1e6)
        finally:
            await store.close()
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds, after one of warm-up")
    parser.add_argument("--rollouts", type=int, default=768, help="rollouts a round (the demo's phase: 768)")
    parser.add_argument("--concurrency", type=int, default=128, help="runners in the fleet (the demo's: 128)")
    args = parser.parse_args()
    clock = StoreClock()
    clock.install()
    per_round = asyncio.run(measure(args, clock))
    rollouts = args.rounds * args.rollouts
    print(f"\n{args.rounds} rounds of {args.rollouts} rollouts, {args.concurrency} runners\n")
    print("| | us of CPU a rollout |\n|---|---|")
    print(f"| the process, median of the rounds | {statistics.median(per_round):.0f} |")
    print(f"| the process, least of the rounds | {min(per_round):.0f} |")
    for name, seconds in clock.seconds.most_common():
        print(f"| store thread: `{name}` ({clock.calls[name]} calls) | {seconds / rollouts * 1e6:.1f} |")


if __name__ == "__main__":
    main()
