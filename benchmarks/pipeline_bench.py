"""The pipeline's ceiling: rollouts per second through the whole product path, with an LLM that answers at once.

    store server (`lightning store serve`, SQLite) <-HTTP-> runner processes (`python -m lightning.runner`)
    runner's agent -> LLM proxy (`lightning proxy serve`, spans into the store server over HTTP)
    LLM proxy -> an instant OpenAI-compatible upstream (tests/support/fixed_backend.py: a fixed answer with vLLM's
    token ids), then this process adapts the rollouts' spans into training rows (`lightning.adapter.adapt_rollouts`)

For 1, 4 and 16 runner processes (`--runners`), then 16 runners as one fleet in this process (`--fleet`: one claim
loop, one tracer, resources read once, as a training run's rollout stage runs them): the runners are started and
idle, then this process enqueues `--rollouts` rollouts of the demo's agent (examples/copy_task/agent.py: one chat
call, a reward) in one request, waits for them all to finish and adapts their spans; "wall s" runs from the enqueue
to the last training row. The store server runs with `--access-log`: every request it answers in that window,
whoever sent it (runners, proxy, this process's enqueue, wait and adapter), is counted by route and divided by the
rollouts. Everything listens on 127.0.0.1 and every process is stopped at the end.

    .venv/bin/python benchmarks/pipeline_bench.py [--rollouts 512] [--runners 1 4 16] [--fleet 16]

Also printed: each process's CPU milliseconds per rollout over the same window (a fleet's is this process's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.copy_task.agent import make_tasks  # noqa: E402
from lightning.adapter import adapt_rollouts  # noqa: E402
from lightning.cli import PROXY_TOKEN_ENV  # noqa: E402
from lightning.serving import free_port  # noqa: E402
from lightning.store.client import HttpLightningStore  # noqa: E402
from lightning.types import EnqueueRolloutRequest, ProxyLLM  # noqa: E402

AGENT = "examples.copy_task.agent:copy_agent"
ROUTE = re.compile(r'"(?:GET|POST|PUT) (/\S*) HTTP')
"""A request line in uvicorn's access log: `127.0.0.1:50310 - "POST /v1/store/dequeue_rollout HTTP/1.1" 200 OK`."""


def start(
    command: list[str], log: Path, health_url: str | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `command` in a process group of its own (output to `log`, `env` added to the environment); wait until
    `health_url` answers 200."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 60
    while health_url is not None:
        if process.poll() is not None:
            raise RuntimeError(f"{command[2:5]} exited ({process.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(health_url, timeout=1, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{command[2:5]} did not answer {health_url} within 60 s")
        time.sleep(0.1)
    return process


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process group, then SIGKILL what is left after 10 s."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def routes_since(access_log: Path, offset: int) -> tuple[Counter[str], int]:
    """Requests per route logged after byte `offset` of the access log, and the log's end."""
    data = access_log.read_bytes()
    found = Counter(match.group(1).removeprefix("/v1/store/") for match in ROUTE.finditer(data[offset:].decode()))
    return found, len(data)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_for_workers(store: HttpLightningStore, worker_ids: set[str], timeout: float = 120.0) -> None:
    """Until every runner has told the store it is there (a runner's first idle poll ends in update_worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page = await store.query_workers(worker_id_contains="bench-")
        if worker_ids <= {worker.worker_id for worker in page.items}:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"runners did not come up within {timeout:.0f} s")


async def measure(
    store: HttpLightningStore, access_log: Path, resources_id: str, rollouts: int, tasks: list[dict]
) -> dict:
    """Enqueue `rollouts`, wait for them, adapt their spans: the seconds of each phase, the training rows made and
    the store's requests by route in each phase."""
    requests = [
        EnqueueRolloutRequest(
            input=tasks[k % len(tasks)], resources_id=resources_id, metadata={"group_id": f"g{k // 4}"}
        )
        for k in range(rollouts)
    ]
    _, offset = routes_since(access_log, 0)
    started = time.perf_counter()
    ids = [rollout.rollout_id for rollout in await store.enqueue_many_rollouts(requests)]
    finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=600)
    ran = time.perf_counter()
    ran_routes, offset = routes_since(access_log, offset)
    adapted = await adapt_rollouts(store, ids)
    ended = time.perf_counter()
    adapt_routes, _ = routes_since(access_log, offset)
    succeeded = sum(rollout.status == "succeeded" for rollout in finished)
    if succeeded != rollouts:
        raise RuntimeError(f"{succeeded} of {rollouts} rollouts succeeded ({len(finished)} finished)")
    return {
        "rollouts": rollouts, "seconds": ended - started, "run_seconds": ran - started, "adapt_seconds": ended - ran,
        "training_rows": len(adapted.triplets), "run_routes": ran_routes, "adapt_routes": adapt_routes,
        "routes": ran_routes + adapt_routes,
    }  # fmt: skip


@contextlib.asynccontextmanager
async def runner_processes(
    count: int, store: HttpLightningStore, store_url: str, workdir: Path
) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """`count` runner processes (`python -m lightning.runner`), each running one rollout at a time, started and
    idle; stopped on exit."""
    worker_ids = {f"bench-{count}-{i}" for i in range(count)}
    runners = []
    try:
        for worker_id in sorted(worker_ids):
            command = [sys.executable, "-m", "lightning.runner", "--store", store_url, "--agent", AGENT]
            runners.append(start([*command, "--worker-id", worker_id], workdir / f"{worker_id}.log"))
        await wait_for_workers(store, worker_ids)
        yield runners
    finally:
        stop(runners)


@contextlib.asynccontextmanager
async def runner_fleet(count: int, store_url: str) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """`count` runners on this process's event loop, as a training run's rollout stage runs them
    (`lightning.runner.fleet.run_fleet_until`): one claim loop (`run_fleet`), one tracer, resources brought by the
    claims; its own store client. No processes to yield: its CPU is this process's."""
    from lightning.config import load_agent
    from lightning.runner import Runner, run_fleet
    from lightning.tracing import Tracer

    store = HttpLightningStore(store_url)
    tracer = Tracer(store)
    agent = load_agent(AGENT)
    fleet = [Runner(agent, store, tracer=tracer, worker_id=f"fleet-{i}") for i in range(count)]
    stop_event = asyncio.Event()
    working = asyncio.create_task(run_fleet(fleet, store, stop_event=stop_event, idle_wait=0.05))
    try:
        yield []
    finally:
        stop_event.set()
        await working
        await asyncio.to_thread(tracer.shutdown)
        await store.close()


async def bench(args: argparse.Namespace, workdir: Path) -> list[dict]:
    python = sys.executable
    store_port, proxy_port, backend_port = free_port(), free_port(), free_port()
    store_url, proxy_url = f"http://127.0.0.1:{store_port}", f"http://127.0.0.1:{proxy_port}"
    backend_url = f"http://127.0.0.1:{backend_port}"
    access_log = workdir / "store.log"
    servers = []
    rows = []
    store = HttpLightningStore(store_url)
    try:
        servers.append(start([python, "tests/support/fixed_backend.py", str(backend_port)], workdir / "backend.log"))
        serve = ["store", "serve", "--port", str(store_port), "--db", f"sqlite:///{workdir}/store.db", "--access-log"]
        servers.append(start([python, "-m", "lightning.cli", *serve], access_log, f"{store_url}/health"))
        proxy = ["proxy", "serve", "--store", store_url, "--backend", f"{backend_url}/v1", "--port", str(proxy_port)]
        # With a token, as a training run's proxy has: the runners' routes are signed with it, so the proxy takes
        # their attempts as known instead of asking the store (lightning.types.route_signature).
        token = secrets.token_urlsafe(24)
        proxy_log, proxy_health = workdir / "proxy.log", f"{proxy_url}/health"
        servers.append(
            start([python, "-m", "lightning.cli", *proxy], proxy_log, proxy_health, {PROXY_TOKEN_ENV: token})
        )
        resources = await store.update_resources(
            "bench", {"main_llm": ProxyLLM(endpoint=f"{proxy_url}/v1", model="policy", api_key=token)}
        )
        tasks = make_tasks(64, seed=0)
        n = args.rollouts
        setups = [(str(count), runner_processes(count, store, store_url, workdir)) for count in args.runners]
        setups += [(f"{count} (fleet)", runner_fleet(count, store_url)) for count in args.fleet]
        for label, setup in setups:
            async with setup as runners:
                groups = {"store server": [servers[1]], "proxy": [servers[2]], "upstream": [servers[0]]}
                groups["runner processes"] = runners
                cpu_before = {name: sum(cpu_seconds(p.pid) for p in group) for name, group in groups.items()}
                here_before = time.process_time()
                row = {"runners": label, **await measure(store, access_log, resources.resources_id, n, tasks)}
                cpu = {
                    name: sum(cpu_seconds(p.pid) for p in group) - cpu_before[name] for name, group in groups.items()
                }
                cpu["this process"] = time.process_time() - here_before
            rows.append(row)
            print(
                f"runners {label}: {n / row['seconds']:.1f} rollouts/s, {row['training_rows']} training rows; "
                f"rollouts {row['run_seconds']:.2f} s, {row['run_routes'].total() / n:.2f} store requests/rollout; "
                f"adapter {row['adapt_seconds']:.2f} s, {row['adapt_routes'].total() / n:.2f} store requests/rollout",
                flush=True,
            )
            print("  CPU ms/rollout: " + ", ".join(f"{name} {1000 * s / n:.1f}" for name, s in cpu.items()), flush=True)
    finally:
        await store.close()
        stop(servers)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=512, help="rollouts per runner count")
    parser.add_argument("--runners", type=int, nargs="*", default=[1, 4, 16], help="runner processes, in turn")
    parser.add_argument(
        "--fleet", type=int, nargs="*", default=[16], help="then runners as one fleet in this process, in turn"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    load_before = os.getloadavg()
    rows = asyncio.run(bench(args, workdir))
    load_after = os.getloadavg()
    print(
        f"\nThe pipeline's ceiling (store server -> runners -> LLM proxy -> instant upstream -> spans -> "
        f"adapter); {os.cpu_count()} cores, load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} "
        f"after; logs in {workdir}"
    )
    print("| runners | rollouts | wall s | rollouts/s | store requests/rollout | top routes (requests/rollout) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        n, routes = row["rollouts"], row["routes"]
        top = ", ".join(f"{route} {count / n:.2f}" for route, count in routes.most_common(3))
        print(f"| {row['runners']} | {n} | {row['seconds']:.1f} | {n / row['seconds']:.1f} "
              f"| {routes.total() / n:.2f} | {top} |")  # fmt: skip
    print("\nStore requests per rollout (in all), by route; rollouts: from the enqueue to the last rollout finished")
    print("| route | phase | " + " | ".join(f"runners {row['runners']}" for row in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for phase, key in (("rollouts", "run_routes"), ("adapter", "adapt_routes")):
        routes = sorted({route for row in rows for route in row[key]}, key=lambda r: -sum(row[key][r] for row in rows))
        for route in routes:
            cells = " | ".join(f"{row[key][route] / row['rollouts']:.2f} ({row[key][route]})" for row in rows)
            print(f"| {route} | {phase} | {cells} |")


if __name__ == "__main__":
    main()
