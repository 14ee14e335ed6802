"""What the LLM proxy adds to a call: median latency through the proxy minus straight to the backend,
at 1 and 16 concurrent calls, streaming and not; the proxy's CPU per call; spans stored per call.
Optionally (--model DIR or --tiny) the embedded inference server's throughput at 1 and 16
concurrent requests.

Three processes on 127.0.0.1: a fast fixed-answer backend (tests/support/fixed_backend.py), the
proxy (`lightning proxy serve`, spans into a SQLite store), and this client. Direct and proxied
rounds alternate so that drift on a shared machine hits both sides alike.

    .venv/bin/python benchmarks/proxy_bench.py [--calls 400] [--rounds 3] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning.serving import free_port  # noqa: E402
from lightning.store import SqlLightningStore  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 2+2? Answer with the number alone."}]


def start(command: list[str], url: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(f"{command[:4]} did not answer on {url}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed_calls(urls: list[str], body: dict, calls: int, concurrency: int) -> list[float]:
    """Latencies (s) of `calls` calls made by `concurrency` workers; worker k uses urls[k % len]."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:

        async def worker(k: int, count: int) -> None:
            url = urls[k % len(urls)]
            for _ in range(count):
                started = time.perf_counter()
                if body.get("stream"):
                    async with http.stream("POST", url, json=body) as response:
                        async for _ in response.aiter_raw():
                            pass
                else:
                    response = await http.post(url, json=body)
                    response.read()
                latencies.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text

        await worker(0, 5)  # warm connections and code paths
        latencies.clear()
        await asyncio.gather(*(worker(k, calls // concurrency) for k in range(concurrency)))
    return latencies


async def bench_proxy(args: argparse.Namespace) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    db = f"sqlite:///{workdir}/store.db"
    store = SqlLightningStore(db, watchdog_interval=None)
    attempts = [await store.start_rollout({"bench": k}) for k in range(16)]
    backend_port, proxy_port = free_port(), free_port()
    backend_url, proxy_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{proxy_port}"
    python = sys.executable
    backend = start([python, "tests/support/fixed_backend.py", str(backend_port)], backend_url)
    proxy_cmd = [python, "-m", "lightning.cli", "proxy", "serve", "--store", db, "--backend", f"{backend_url}/v1"]
    proxy = start([*proxy_cmd, "--port", str(proxy_port)], proxy_url)
    routed = [
        f"{proxy_url}/rollout/{a.rollout_id}/attempt/{a.attempt.attempt_id}/v1/chat/completions" for a in attempts
    ]
    direct = [f"{backend_url}/v1/chat/completions"]
    rows = []
    try:
        for stream in (False, True):
            for concurrency in (1, 16):
                # Direct calls ask for token ids too, so both sides move the same bytes.
                body = {"model": "policy", "messages": MESSAGES, "stream": stream, "return_token_ids": True}
                calls = args.calls if concurrency == 1 else args.calls * 4
                direct_ms, proxied_ms, cpu = [], [], 0.0
                for _ in range(args.rounds):
                    direct_ms += [x * 1000 for x in await timed_calls(direct, body, calls, concurrency)]
                    before = cpu_seconds(proxy.pid)
                    proxied_ms += [x * 1000 for x in await timed_calls(routed, body, calls, concurrency)]
                    cpu += cpu_seconds(proxy.pid) - before
                direct_p50, proxied_p50 = statistics.median(direct_ms), statistics.median(proxied_ms)
                rows.append(
                    {
                        "stream": stream,
                        "concurrency": concurrency,
                        "direct_p50_ms": direct_p50,
                        "proxied_p50_ms": proxied_p50,
                        "added_p50_ms": proxied_p50 - direct_p50,
                        "proxied_p95_ms": statistics.quantiles(proxied_ms, n=20)[18],
                        "proxy_cpu_ms_per_call": cpu * 1000 / len(proxied_ms),
                        "calls": len(proxied_ms),
                    }
                )
                print(f"  done: stream={stream} concurrency={concurrency}", file=sys.stderr, flush=True)
        status = httpx.get(f"{proxy_url}/admin/status").json()
        spans = sum([len(await store.query_spans(a.rollout_id)) for a in attempts])
        proxied_calls = sum(r["calls"] for r in rows) + 5 * args.rounds * len(rows)
        with_ids = 0
        for a in attempts:
            for span in await store.query_spans(a.rollout_id):
                with_ids += "lightning.llm.response_token_ids" in span.attributes
        print(
            f"spans stored: {spans} for {proxied_calls} proxied calls ({spans / proxied_calls:.3f} per call), "
            f"{with_ids} with token ids; proxy status: calls={status['calls']} failed={status['spans_failed']}"
        )
    finally:
        for process in (proxy, backend):
            process.terminate()
            process.wait(10)
        await store.close()
    return rows


async def bench_server(model_dir: Path, max_tokens: int) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start([sys.executable, "-m", "lightning.inference", "--model", str(model_dir), "--port", str(port)], url)
    rows = []
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            name = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]

            async def one(seed: int) -> int:
                body = {
                    "model": name,
                    "prompt": "Once upon a time",
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": seed,
                    "stop": [],
                }
                response = (await http.post(f"{url}/v1/completions", json=body)).json()
                return response["usage"]["completion_tokens"]

            await one(0)  # warm up
            for concurrency in (1, 16):
                started = time.perf_counter()
                rounds = 4 if concurrency == 1 else 2
                tokens = 0
                for r in range(rounds):
                    tokens += sum(await asyncio.gather(*(one(r * 100 + k) for k in range(concurrency))))
                elapsed = time.perf_counter() - started
                rows.append({"concurrency": concurrency, "tokens": tokens, "tokens_per_s": tokens / elapsed})
    finally:
        server.terminate()
        server.wait(10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400, help="calls per round at concurrency 1 (x4 at 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="also measure the embedded server on this model")
    parser.add_argument("--tiny", action="store_true", help="also measure the embedded server on the tiny model")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    load = MachineLoad()

    rows = asyncio.run(bench_proxy(args))
    print("\nLLM proxy: latency added over calling the backend directly (medians; ms)")
    print("| stream | concurrent | direct p50 | proxied p50 | added p50 | proxied p95 | proxy CPU/call |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'yes' if r['stream'] else 'no'} | {r['concurrency']} | {r['direct_p50_ms']:.2f} | "
            f"{r['proxied_p50_ms']:.2f} | {r['added_p50_ms']:.2f} | {r['proxied_p95_ms']:.2f} | "
            f"{r['proxy_cpu_ms_per_call']:.2f} |"
        )
    print("agent-lightning 0.3's LiteLLM-based proxy, measured in this setting (issue 4): about 31 ms added at 1 call.")

    server_rows = []
    model_dir = args.model
    if args.tiny and model_dir is None:
        from lightning.models import build_tiny_model

        model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")) / "tiny")
    if model_dir is not None:
        server_rows = asyncio.run(bench_server(model_dir, args.max_tokens))
        print(f"\nEmbedded inference server ({model_dir}): {args.max_tokens} new tokens per request")
        print("| concurrent requests | tokens | tokens/s |")
        print("|---|---|---|")
        for r in server_rows:
            print(f"| {r['concurrency']} | {r['tokens']} | {r['tokens_per_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"proxy": rows, "server": server_rows}, indent=2))
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
