"""Throughput and latency of SqlLightningStore next to agent-lightning 0.3's InMemoryLightningStore;
with --http, of each store's HTTP client against its server running in a separate process. Ours runs on a
SQLite file, or with --postgres on a PostgreSQL server (a scratch database per workload, dropped after it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parents[1]

SINGLE_ENQUEUES = 2_000
ENQUEUE_BATCHES, ENQUEUE_BATCH_SIZE = 20, 100
QUEUE_LENGTH = 2_000
WORKER_COUNTS = (1, 4, 16)
SPAN_ROLLOUTS, SPANS_PER_ROLLOUT = 200, 100
QUERY_SPANS, QUERY_COUNT, QUERY_WARMUP = 100, 200, 10

# (key, label shown in the table, workload letter, "rate" (higher is better) or "latency" (lower is better))
ROWS: list[tuple[str, str, str, str]] = [
    ("enqueue_single", f"(a) enqueue_rollout x{SINGLE_ENQUEUES:,} (rollouts/s)", "a", "rate"),
    (
        "enqueue_batch",
        f"(a) enqueue_many_rollouts {ENQUEUE_BATCHES}x{ENQUEUE_BATCH_SIZE} (rollouts/s)",
        "a",
        "rate",
    ),
    *[
        (f"cycle_{n}", f"(b) dequeue+finish, {n} worker{'s' if n > 1 else ''} (cycles/s)", "b", "rate")
        for n in WORKER_COUNTS
    ],
    ("add_span", f"(c) add_span x{SPAN_ROLLOUTS * SPANS_PER_ROLLOUT:,} (spans/s)", "c", "rate"),
    (
        "add_many_spans",
        f"(c) add_many_spans {SPAN_ROLLOUTS}x{SPANS_PER_ROLLOUT} (spans/s)",
        "c",
        "rate",
    ),
    ("query_p50", f"(d) query_spans, {QUERY_SPANS} spans, p50 (ms)", "d", "latency"),
    ("query_p95", f"(d) query_spans, {QUERY_SPANS} spans, p95 (ms)", "d", "latency"),
]


@dataclass(frozen=True)
class Adapter:
    """What differs between the two stores: how to open one, and their Span / EnqueueRolloutRequest types."""

    description: str
    open_store: Callable[[], AbstractAsyncContextManager[Any]]
    span_type: Any
    request_type: Any

    def span(self, fields: dict[str, Any]) -> Any:
        return self.span_type.model_validate(fields)

    def request(self, fields: dict[str, Any]) -> Any:
        return self.request_type.model_validate(fields)


def ours_adapter(http: bool = False, postgres: str | None = None, threaded: bool = True) -> Adapter:
    """`postgres`: a PostgreSQL server's URL (postgresql://user@host:port/db); each store gets a scratch database
    there. Without it, a SQLite file in a temporary folder. `threaded=False`: in process, SQLite transactions run on
    the caller's loop instead of the store's own thread (as `lightning store serve` runs them)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from lightning.store import SqlLightningStore
    from lightning.types import EnqueueRolloutRequest, Span

    @contextlib.contextmanager
    def database(folder: Path) -> Iterator[str]:
        if postgres is None:
            yield f"sqlite:///{folder}/store.db"
        else:
            with scratch_database(postgres) as url:
                yield url

    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[Any]:
        with scratch_folder("store_bench_") as folder, database(folder) as url:
            async with closed_after(SqlLightningStore(url, watchdog_interval=None, threaded=threaded)) as store:
                yield store

    @contextlib.asynccontextmanager
    async def open_http_store() -> AsyncIterator[Any]:
        from lightning.store.client import HttpLightningStore

        port = free_port()
        with scratch_folder("store_bench_") as folder, database(folder) as url:
            command = [sys.executable, "-m", "lightning.cli", "store", "serve", "--port", str(port)]
            command += ["--db", url, "--log-level", "warning"]
            with server_process(command, f"http://127.0.0.1:{port}/health", folder):
                async with closed_after(HttpLightningStore(f"http://127.0.0.1:{port}")) as store:
                    yield store

    backend = "SQLite file, WAL" if postgres is None else f"PostgreSQL {postgres_version(postgres)}"
    if http:
        description = f"lightning HttpLightningStore -> `lightning store serve` ({backend}) in its own process"
        return Adapter(description, open_http_store, Span, EnqueueRolloutRequest)
    description = f"lightning SqlLightningStore ({backend}{'' if threaded else ', threaded=False'})"
    return Adapter(description, open_store, Span, EnqueueRolloutRequest)


def peer_adapter(http: bool = False) -> Adapter:
    from importlib.metadata import version

    # agentlightning imports litellm, which otherwise fetches a price list over the network in a thread.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from agentlightning.store.memory import InMemoryLightningStore
    from agentlightning.types import EnqueueRolloutRequest, Span

    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[Any]:
        # InMemoryLightningStore has no close(); dropping the reference is all there is.
        yield InMemoryLightningStore()

    @contextlib.asynccontextmanager
    async def open_http_store() -> AsyncIterator[Any]:
        # `agl store`: LightningStoreServer over a thread-safe InMemoryLightningStore, its own process.
        from agentlightning.store.client_server import LightningStoreClient

        port = free_port()
        command = [sys.executable, "-m", "agentlightning.cli.store", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--log-level", "WARNING"]
        health = f"http://127.0.0.1:{port}/v1/agl/health"
        with scratch_folder("store_bench_peer_") as folder, server_process(command, health, folder):
            async with closed_after(LightningStoreClient(f"http://127.0.0.1:{port}")) as store:
                yield store

    name = f"agentlightning {version('agentlightning')}"
    if http:
        description = f"{name} LightningStoreClient -> LightningStoreServer (InMemoryLightningStore), own process"
        return Adapter(description, open_http_store, Span, EnqueueRolloutRequest)
    return Adapter(f"{name} InMemoryLightningStore", open_store, Span, EnqueueRolloutRequest)


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A new temporary folder, removed with all it holds at the end."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.asynccontextmanager
async def closed_after(store: Any) -> AsyncIterator[Any]:
    """`store`, closed (`await store.close()`) at the end."""
    try:
        yield store
    finally:
        await store.close()


def psycopg_url(url: str) -> str:
    """A store URL (postgresql[+driver]://...) as psycopg takes it."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def postgres_version(server_url: str) -> str:
    import psycopg

    with psycopg.connect(psycopg_url(server_url), autocommit=True) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])


_scratch_count = 0


@contextlib.contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new, empty database `store_bench_<pid>_<n>` on the server of `server_url`, dropped at the end; its URL.
    Only ever drops the database it made."""
    import psycopg

    global _scratch_count
    _scratch_count += 1
    name = f"store_bench_{os.getpid()}_{_scratch_count}"
    admin = psycopg_url(server_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        parts = urlsplit(server_url)
        yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(command: list[str], health_url: str, folder: Path) -> Iterator[None]:
    """Run a store server as `command` (its output in folder/server.log) until it answers health_url."""
    log_path = folder / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(process, health_url, log_path)
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_healthy(process: subprocess.Popen[bytes], health_url: str, log_path: Path) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"store server exited ({process.returncode}): {log_path.read_text()[-2000:]}")
        try:
            with opener.open(health_url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"store server did not answer {health_url} within 60 s: {log_path.read_text()[-2000:]}")


# --- inputs ----------------------------------------------------------------------------------


def task_input(index: int) -> dict[str, Any]:
    return {"question": f"What is {index} + {index * 7}?", "answer": str(index * 8), "index": index}


def span_fields(rollout_id: str, attempt_id: str, sequence_id: int, index: int) -> dict[str, Any]:
    """A chat-completion span as a tracer records it: model, token counts, prompt and response token ids."""
    trace_id = f"{index // SPANS_PER_ROLLOUT:032x}"
    span_id = f"{index + 1:016x}"
    prompt_ids = [151_644 + (index * 31 + k * 17) % 5_000 for k in range(20)]
    response_ids = [198 + (index * 13 + k * 7) % 9_000 for k in range(20)]
    start = 1_700_000_000.0 + index * 0.01
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": sequence_id,
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": None,
        "name": "openai.chat.completion",
        "status": {"status_code": "OK", "description": None},
        "attributes": {
            "gen_ai.system": "openai",
            "gen_ai.request.model": "Qwen/Qwen2.5-1.5B-Instruct",
            "gen_ai.usage.prompt_tokens": len(prompt_ids),
            "gen_ai.usage.completion_tokens": len(response_ids),
            "prompt_token_ids": str(prompt_ids),
            "response_token_ids": str(response_ids),
        },
        "events": [],
        "links": [],
        "start_time": start,
        "end_time": start + 0.25,
        "context": {"trace_id": trace_id, "span_id": span_id, "is_remote": False, "trace_state": {}},
        "parent": None,
        "resource": {"attributes": {"service.name": "store-bench"}, "schema_url": ""},
    }


async def enqueue_queue(store: Any, adapter: Adapter, count: int) -> None:
    for start in range(0, count, ENQUEUE_BATCH_SIZE):
        indices = range(start, min(count, start + ENQUEUE_BATCH_SIZE))
        await store.enqueue_many_rollouts([adapter.request({"input": task_input(i)}) for i in indices])


async def claimed_rollout_spans(store: Any, adapter: Adapter, rollouts: int, per_rollout: int) -> list[Any]:
    """Enqueue and dequeue `rollouts` rollouts; build `per_rollout` spans each, with store-issued ids."""
    await enqueue_queue(store, adapter, rollouts)
    spans: list[Any] = []
    for r in range(rollouts):
        claimed = await store.dequeue_rollout(worker_id="bench")
        if claimed is None:
            raise RuntimeError(f"dequeue_rollout returned None after {r} of {rollouts} rollouts")
        rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
        sequence_ids = list(await store.get_many_span_sequence_ids([(rollout_id, attempt_id)] * per_rollout))
        if len(set(sequence_ids)) != per_rollout:
            raise RuntimeError(f"get_many_span_sequence_ids gave repeated ids: {sequence_ids}")
        spans.extend(
            adapter.span(span_fields(rollout_id, attempt_id, seq, r * per_rollout + k))
            for k, seq in enumerate(sequence_ids)
        )
    return spans


# --- workloads -------------------------------------------------------------------------------


async def measure_enqueue_single(adapter: Adapter) -> float:
    async with adapter.open_store() as store:
        started = time.perf_counter()
        for i in range(SINGLE_ENQUEUES):
            await store.enqueue_rollout(input=task_input(i))
        return SINGLE_ENQUEUES / (time.perf_counter() - started)


async def measure_enqueue_batch(adapter: Adapter) -> float:
    async with adapter.open_store() as store:
        total = ENQUEUE_BATCHES * ENQUEUE_BATCH_SIZE
        requests = [adapter.request({"input": task_input(i)}) for i in range(total)]
        batches = [requests[i : i + ENQUEUE_BATCH_SIZE] for i in range(0, len(requests), ENQUEUE_BATCH_SIZE)]
        started = time.perf_counter()
        for batch in batches:
            await store.enqueue_many_rollouts(batch)
        return total / (time.perf_counter() - started)


async def measure_dequeue_finish_cycles(adapter: Adapter, workers: int) -> float:
    async with adapter.open_store() as store:
        await enqueue_queue(store, adapter, QUEUE_LENGTH)

        async def work(worker_id: str) -> int:
            cycles = 0
            while (claimed := await store.dequeue_rollout(worker_id=worker_id)) is not None:
                await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
                cycles += 1
            return cycles

        started = time.perf_counter()
        done = await asyncio.gather(*(work(f"worker-{w}") for w in range(workers)))
        elapsed = time.perf_counter() - started
        if sum(done) != QUEUE_LENGTH:
            raise RuntimeError(f"{workers} workers finished {sum(done)} rollouts, expected {QUEUE_LENGTH}")
        return QUEUE_LENGTH / elapsed


async def measure_add_span(adapter: Adapter) -> float:
    async with adapter.open_store() as store:
        spans = await claimed_rollout_spans(store, adapter, SPAN_ROLLOUTS, SPANS_PER_ROLLOUT)
        started = time.perf_counter()
        for span in spans:
            await store.add_span(span)
        return len(spans) / (time.perf_counter() - started)


async def measure_add_many_spans(adapter: Adapter) -> float:
    async with adapter.open_store() as store:
        spans = await claimed_rollout_spans(store, adapter, SPAN_ROLLOUTS, SPANS_PER_ROLLOUT)
        batches = [spans[i : i + SPANS_PER_ROLLOUT] for i in range(0, len(spans), SPANS_PER_ROLLOUT)]
        started = time.perf_counter()
        for batch in batches:
            await store.add_many_spans(batch)
        return len(spans) / (time.perf_counter() - started)


async def measure_query_spans_latency(adapter: Adapter) -> tuple[float, float]:
    """p50 and p95 in milliseconds of query_spans(rollout_id) on a rollout holding QUERY_SPANS spans."""
    async with adapter.open_store() as store:
        spans = await claimed_rollout_spans(store, adapter, 1, QUERY_SPANS)
        await store.add_many_spans(spans)
        rollout_id = spans[0].rollout_id
        latencies: list[float] = []
        for i in range(QUERY_WARMUP + QUERY_COUNT):
            started = time.perf_counter()
            found = await store.query_spans(rollout_id)
            elapsed = time.perf_counter() - started
            if len(found) != QUERY_SPANS:
                raise RuntimeError(f"query_spans returned {len(found)} spans, expected {QUERY_SPANS}")
            if i >= QUERY_WARMUP:
                latencies.append(elapsed * 1000)
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        return cuts[49], cuts[94]


async def run_workloads(adapter: Adapter, side: str, repeat: int, only: set[str]) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {key: [] for key, _, letter, _ in ROWS if letter in only}

    def record(key: str, value: float, run: int) -> None:
        results[key].append(value)
        label = next(label for k, label, _, _ in ROWS if k == key)
        print(f"[{side}] run {run}/{repeat}  {label}: {value:,.2f}", file=sys.stderr, flush=True)

    for run in range(1, repeat + 1):
        if "a" in only:
            record("enqueue_single", await measure_enqueue_single(adapter), run)
            record("enqueue_batch", await measure_enqueue_batch(adapter), run)
        if "b" in only:
            for workers in WORKER_COUNTS:
                record(f"cycle_{workers}", await measure_dequeue_finish_cycles(adapter, workers), run)
        if "c" in only:
            record("add_span", await measure_add_span(adapter), run)
            record("add_many_spans", await measure_add_many_spans(adapter), run)
        if "d" in only:
            p50, p95 = await measure_query_spans_latency(adapter)
            record("query_p50", p50, run)
            record("query_p95", p95, run)
    return results


# --- driver ----------------------------------------------------------------------------------


def run_worker(
    side: str,
    repeat: int,
    only: set[str],
    json_path: Path | None,
    http: bool,
    postgres: str | None = None,
    threaded: bool = True,
) -> None:
    """Run the workloads on one store here; print {"description", "python", "results"} as JSON."""
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print must not corrupt the JSON on stdout
    try:
        adapter = ours_adapter(http, postgres, threaded) if side == "ours" else peer_adapter(http)
        # Keep the imported modules out of the collector's full passes; agentlightning imports so much
        # (litellm, openai, ...) that one such pass otherwise costs several times a 2,000-call workload.
        gc.collect()
        gc.freeze()
        banner = f"[{side}] {adapter.description}, Python {platform.python_version()}"
        print(banner, file=sys.stderr, flush=True)
        results = asyncio.run(run_workloads(adapter, side, repeat, only))
    finally:
        sys.stdout = real_stdout
    payload = {"description": adapter.description, "python": platform.python_version(), "results": results}
    print(json.dumps(payload), flush=True)
    if json_path:
        json_path.write_text(json.dumps(payload, indent=2) + "\n")


def spawn_worker(
    python: str, side: str, repeat: int, only: str, http: bool, postgres: str | None = None, threaded: bool = True
) -> dict[str, Any]:
    """Run this file as `--worker side` under `python`: progress on our stderr, the JSON comes back."""
    command = [python, str(Path(__file__).resolve()), "--worker", side, "--repeat", str(repeat)]
    command += ["--only", only, *(["--http"] if http else []), *(["--postgres", postgres] if postgres else [])]
    command += [] if threaded else ["--unthreaded"]
    completed = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    if completed.returncode != 0:
        raise SystemExit(f"{side} worker failed (exit {completed.returncode}): {' '.join(command)}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.2f}" for value in load)


def format_table(ours: dict[str, Any], peer: dict[str, Any] | None, only: set[str]) -> str:
    header = ("workload", "ours", "peer", "ours/peer")
    lines: list[tuple[str, str, str, str]] = []
    for key, label, letter, kind in ROWS:
        if letter not in only:
            continue
        mine = statistics.median(ours["results"][key])
        theirs = statistics.median(peer["results"][key]) if peer else None
        ratio = f"{mine / theirs:.2f}x" if theirs else "-"
        note = "" if kind == "rate" else " (lower is better)"
        lines.append((label + note, f"{mine:,.2f}", "-" if theirs is None else f"{theirs:,.2f}", ratio))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(4)]

    def fmt(row: tuple[str, str, str, str]) -> str:
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        cells = [row[0].ljust(widths[0]), *rest]
        return " | ".join(cells)

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(row) for row in lines)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload; the table shows the median")
    parser.add_argument("--only", default="a,b,c,d", help="comma-separated workloads among a,b,c,d")
    parser.add_argument("--peer-python", help="a Python with agentlightning 0.3, for the peer side")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--http",
        action="store_true",
        help="through each store's HTTP client, against its server started in a separate process on 127.0.0.1",
    )
    parser.add_argument(
        "--postgres",
        metavar="URL",
        help="run ours on this PostgreSQL server (postgresql://user@host:port/db) instead of a SQLite file: each "
        "workload creates a scratch database store_bench_<pid>_<n> there and drops it after (only that one)",
    )
    parser.add_argument(
        "--unthreaded",
        action="store_true",
        help="in process: ours with threaded=False (transactions on the caller's loop, not the store's thread)",
    )
    parser.add_argument("--worker", choices=("ours", "peer"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    only = {w.strip() for w in args.only.split(",") if w.strip()}
    if not only or only - {"a", "b", "c", "d"}:
        parser.error(f"--only takes workloads among a,b,c,d, got {args.only!r}")
    if args.worker:
        run_worker(args.worker, args.repeat, only, args.json, args.http, args.postgres, not args.unthreaded)
        return

    selected = ",".join(sorted(only))
    load_at_start = os.getloadavg()
    if args.postgres and not args.postgres.startswith(("postgresql://", "postgresql+", "postgres://")):
        parser.error(f"--postgres takes a postgresql://user@host:port/db URL, got {args.postgres!r}")
    ours = spawn_worker(sys.executable, "ours", args.repeat, selected, args.http, args.postgres, not args.unthreaded)
    peer = spawn_worker(args.peer_python, "peer", args.repeat, selected, args.http) if args.peer_python else None

    print(f"ours: {ours['description']}, Python {ours['python']}")
    if peer:
        print(f"peer: {peer['description']}, Python {peer['python']}")
    print(f"median of {args.repeat} run(s) per row; each run on a fresh store")
    load_at_end = os.getloadavg()
    print(f"load average (1, 5, 15 min): {fmt_load(load_at_start)} at the start, {fmt_load(load_at_end)} at the end\n")
    print(format_table(ours, peer, only))
    if args.json:
        raw = {"repeat": args.repeat, "http": args.http, "postgres": bool(args.postgres), "ours": ours, "peer": peer}
        args.json.write_text(json.dumps(raw, indent=2) + "\n")


if __name__ == "__main__":
    main()
