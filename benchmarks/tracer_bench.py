"""End-to-end span throughput of the tracer: agent code emitting spans inside trace contexts, to rows in SQLite."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning.store import SqlLightningStore  # noqa: E402
from lightning.tracing import Tracer, emit_message  # noqa: E402


@dataclass(frozen=True)
class Workload:
    attempts: int
    spans_per_attempt: int
    agents: int
    flush_interval: float
    max_batch: int
    step_seconds: float = 0.0
    """Time an agent step takes besides emitting (an LLM or tool call); 0: agents do nothing but emit."""


@dataclass(frozen=True)
class Result:
    spans: int
    rows: int
    seconds: float
    exit_latencies: list[float]

    @property
    def spans_per_second(self) -> float:
        return self.rows / self.seconds


def emit_step_span(step: int) -> None:
    """What an agent step records: a message span with five attributes, the body included."""
    emit_message(f"step {step}: called the tool", turn=step, role="assistant", tool="search", latency_ms=12.5)


async def new_attempts(store: SqlLightningStore, count: int) -> list[tuple[str, str]]:
    started = [await store.start_rollout({"task": i}) for i in range(count)]
    return [(rollout.rollout_id, rollout.attempt.attempt_id) for rollout in started]


def run_in_threads(tracer: Tracer, attempts: list[tuple[str, str]], workload: Workload) -> list[float]:
    """`agents` threads take attempts off a queue; each attempt is one trace context. Returns exit latencies."""
    todo: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
    for ids in attempts:
        todo.put(ids)
    latencies: list[float] = []
    lock = threading.Lock()

    def agent() -> None:
        while True:
            try:
                rollout_id, attempt_id = todo.get_nowait()
            except queue.Empty:
                return
            with tracer.trace_context(rollout_id, attempt_id, name="agent"):
                for step in range(workload.spans_per_attempt):
                    if workload.step_seconds:
                        time.sleep(workload.step_seconds)
                    emit_step_span(step)
                exiting = time.perf_counter()
            with lock:
                latencies.append(time.perf_counter() - exiting)

    threads = [threading.Thread(target=agent) for _ in range(workload.agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


async def run_in_tasks(tracer: Tracer, attempts: list[tuple[str, str]], workload: Workload) -> list[float]:
    """`agents` asyncio tasks in one loop, each `async with` a trace context per attempt."""
    todo = list(reversed(attempts))
    latencies: list[float] = []

    async def agent() -> None:
        while todo:
            rollout_id, attempt_id = todo.pop()
            async with tracer.trace_context(rollout_id, attempt_id, name="agent"):
                for step in range(workload.spans_per_attempt):
                    if workload.step_seconds:
                        await asyncio.sleep(workload.step_seconds)
                    elif step % 10 == 0:
                        await asyncio.sleep(0)  # let the other agents interleave, as awaiting an LLM would
                    emit_step_span(step)
                exiting = time.perf_counter()
            latencies.append(time.perf_counter() - exiting)

    await asyncio.gather(*(agent() for _ in range(workload.agents)))
    return latencies


async def measure(mode: str, workload: Workload) -> Result:
    folder = tempfile.mkdtemp(prefix="tracer_bench_")
    store = SqlLightningStore(f"sqlite:///{folder}/store.db", watchdog_interval=None)
    try:
        attempts = await new_attempts(store, workload.attempts)
        tracer = Tracer(store, flush_interval=workload.flush_interval, max_batch=workload.max_batch)
        started = time.perf_counter()
        if mode == "threads":
            latencies = await asyncio.to_thread(run_in_threads, tracer, attempts, workload)
        else:
            latencies = await run_in_tasks(tracer, attempts, workload)
        seconds = time.perf_counter() - started  # every context has exited: every span is in the store
        tracer.shutdown()
        rows = (await store.statistics())["spans"]
    finally:
        await store.close()
    spans = workload.attempts * (workload.spans_per_attempt + 1)  # the root span of each context
    if rows != spans:
        raise RuntimeError(f"{mode}: {spans} spans emitted but {rows} rows in the store")
    return Result(spans=spans, rows=rows, seconds=seconds, exit_latencies=latencies)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarise(results: list[Result]) -> dict[str, float]:
    """Medians over runs: spans/s, and the p50/p95 flush latency at context exit (ms)."""
    return {
        "spans_per_s": statistics.median(r.spans_per_second for r in results),
        "exit_p50_ms": statistics.median(percentile(r.exit_latencies, 0.50) * 1e3 for r in results),
        "exit_p95_ms": statistics.median(percentile(r.exit_latencies, 0.95) * 1e3 for r in results),
        "seconds": statistics.median(r.seconds for r in results),
    }


MODES: dict[str, str] = {"threads": "threads, `with`", "tasks": "asyncio tasks, `async with`"}


def print_table(workload: Workload, rows: dict[tuple[str, float], dict[str, float]], repeat: int) -> None:
    print(
        f"tracer -> SqlLightningStore (SQLite file, WAL): {workload.attempts} attempts x "
        f"{workload.spans_per_attempt} emit_message spans (+1 root span each), {workload.agents} agents at once, "
        f"flush_interval={workload.flush_interval}s, max_batch={workload.max_batch}; median of {repeat} runs"
    )
    print(f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs")
    header = (
        f"| {'agents run as':<27} | {'step takes':<10} | {'spans/s':>9} | {'wall s':>7} "
        f"| {'exit p50 ms':>11} | {'exit p95 ms':>11} |"
    )
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for (mode, step_seconds), row in rows.items():
        step = f"{step_seconds * 1e3:g} ms" if step_seconds else "0 (flood)"
        print(
            f"| {MODES[mode]:<27} | {step:<10} | {row['spans_per_s']:>9,.0f} | {row['seconds']:>7.2f} "
            f"| {row['exit_p50_ms']:>11.1f} | {row['exit_p95_ms']:>11.1f} |"
        )


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed_runs(mode: str, workload: Workload, repeat: int) -> list[Result]:
    results = []
    for run in range(1, repeat + 1):
        result = asyncio.run(measure(mode, workload))
        progress(
            f"{mode}, step {workload.step_seconds * 1e3:g} ms, run {run}/{repeat}: {result.rows:,} rows in "
            f"{result.seconds:.2f}s ({result.spans_per_second:,.0f} spans/s)"
        )
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attempts", type=int, default=200)
    parser.add_argument("--spans", type=int, default=100, help="spans emitted per attempt")
    parser.add_argument("--agents", type=int, default=8, help="agent threads (or asyncio tasks) running at once")
    parser.add_argument("--flush-interval", type=float, default=0.2)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument(
        "--step-ms",
        default="0,2",
        help="comma-separated times an agent step takes besides emitting (an LLM call); 0 floods the tracer",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the table shows the median")
    parser.add_argument("--modes", default="threads,tasks", help="comma-separated among threads,tasks")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    load = MachineLoad()
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose among {sorted(MODES)}")
    steps = [float(ms) / 1e3 for ms in args.step_ms.split(",") if ms]

    base = Workload(args.attempts, args.spans, args.agents, args.flush_interval, args.max_batch)
    rows: dict[tuple[str, float], dict[str, float]] = {}
    raw: list[dict[str, Any]] = []
    for step_seconds in steps:
        for mode in modes:
            workload = replace(base, step_seconds=step_seconds)
            results = timed_runs(mode, workload, args.repeat)
            rows[(mode, step_seconds)] = summarise(results)
            raw += [{"mode": mode, **asdict(workload), **asdict(result)} for result in results]
    print_table(base, rows, args.repeat)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
