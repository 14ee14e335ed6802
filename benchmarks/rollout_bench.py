"""The rollout stage alone, timed: `lightning.stages.collect_rollouts` on an open `Run` (runners -> LLM proxy ->
embedded inference server, spans in a SQLite store), the same batch as benchmarks/trainer_bench.py (16 prompts x 4
samples on the tiny model), without the trainer step in between. Prints seconds per rollout stage; `--profile FILE`
writes a cProfile of the stages (this process only: the proxy and the inference server run in their own).

    .venv/bin/python benchmarks/rollout_bench.py [--iterations 20] [--prompts 16] [--generations 4]
        [--runners 1] [--task-runner default|processes]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.copy_task.agent import make_tasks  # noqa: E402
from lightning import stages  # noqa: E402
from lightning.config import load_config  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.run import Run  # noqa: E402


def process_cpu() -> dict[str, float]:
    """CPU seconds so far: this process (the runners, the agent, the store; all threads) and its child processes by
    what they run (the LLM proxy, the inference server)."""
    cpu = {"runners + agent + store": time.process_time()}
    pending = [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            children = [
                int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()
            ]
        except OSError:
            continue
        pending += children
        if pid == os.getpid():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = (
            "LLM proxy" if "proxy" in command else "inference server" if "inference" in command
            else "runner processes" if "multiprocessing" in command  # the trainer's too: idle here
            else "other"
        )  # fmt: skip
        cpu[name] = cpu.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu


async def bench(args: argparse.Namespace, workdir: Path) -> tuple[list[float], dict[str, float]]:
    model_dir = build_tiny_model(workdir / "tiny", seed=0)
    tasks = make_tasks(96, seed=0)
    for name, part in (("train", tasks[:64]), ("val", tasks[64:])):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(task) + "\n" for task in part))
    sampling = {"temperature": 1.0, "max_tokens": 5}
    config = load_config(
        {
            "run_name": "rollout-bench", "model": str(model_dir), "agent": "examples.copy_task.agent:copy_agent",
            "train_data": str(workdir / "train.jsonl"), "val_data": str(workdir / "val.jsonl"),
            "batch_size": args.prompts, "samples_per_task": args.generations, "n_runners": args.runners,
            "runner_concurrency": -(-args.prompts * args.generations // args.runners),
            "task_runner": args.task_runner, "sampling": sampling,
            "eval_sampling": {**sampling, "temperature": 0.0}, "max_prompt_length": 64, "max_response_length": 6,
            "iterations": 100_000, "checkpoint": {"keep_last": 1, "log_to_mlflow": False},
            "store_url": f"sqlite:///{workdir}/store.db", "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
            "output_dir": str(workdir / "runs"),
        }
    )  # fmt: skip
    run = await Run.open(config)
    profile = cProfile.Profile() if args.profile else None
    seconds = []
    cpu: dict[str, float] = {}
    try:
        for iteration in range(args.warmup + args.iterations):
            measured = iteration >= args.warmup
            cpu_before = process_cpu()
            if profile is not None and measured:
                profile.enable()
            started = time.perf_counter()
            _, summary = await stages.collect_rollouts(run, iteration, "train")
            elapsed = time.perf_counter() - started
            if profile is not None and measured:
                profile.disable()
            if measured:
                seconds.append(elapsed)
                for name, used in process_cpu().items():
                    cpu[name] = cpu.get(name, 0.0) + used - cpu_before.get(name, 0.0)
            print(f"iteration {iteration}: {elapsed * 1000:.0f} ms, {summary['succeeded']} ok", flush=True)
    finally:
        await run.close()
    if profile is not None:
        profile.dump_stats(args.profile)
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="rollout stages measured")
    parser.add_argument("--warmup", type=int, default=2, help="rollout stages run first, not measured")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--runners", type=int, default=1, help="runner tasks (n_runners), sharing the rollouts")
    parser.add_argument(
        "--task-runner", choices=["default", "processes"], default="default",
        help="default: the runners on this process's event loop; processes: in runner processes of the run",
    )  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile of the measured stages here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    load = os.getloadavg()[0]
    seconds, cpu = asyncio.run(bench(args, workdir))
    print(
        f"rollout stage, {args.prompts} x {args.generations} rollouts: median {statistics.median(seconds) * 1000:.0f} "
        f"ms, mean {statistics.mean(seconds) * 1000:.0f} ms, min {min(seconds) * 1000:.0f} ms over {len(seconds)}; "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    stages = len(seconds)
    print("CPU ms per stage: " + ", ".join(f"{name} {1000 * used / stages:.0f}" for name, used in sorted(cpu.items())))


if __name__ == "__main__":
    main()
