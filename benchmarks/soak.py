"""Memory over a long run: the resident memory of every process of a training run (`python -m flows.train`, as a
user runs it) at chosen iterations of a fast config. A nightly run of thousands of iterations must not grow.

    .venv/bin/python benchmarks/soak.py [--iterations 300] [--at 10,100,300]

Prints, for each process (the flow, its temporary Prefect server, the inference server, the LLM proxy, the
trainer), its RSS at each chosen iteration and its growth per iteration after the warm-up (from the second mark).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent

ROLES = {
    "uvicorn": "Prefect server",
    "lightning.lifeline": "(lifeline)",
    "lightning.inference": "inference server",
    "proxy serve": "LLM proxy",
    "multiprocessing.spawn": "trainer",
    "resource_tracker": "(resource tracker)",
}


def fast_config(workdir: Path, iterations: int) -> dict[str, object]:
    """The tiny model on two tasks x two samples, one token each: seconds per iteration, most of it overhead."""
    return {
        "run_name": "soak", "iterations": iterations, "batch_size": 2, "samples_per_task": 2, "n_runners": 1,
        "runner_concurrency": 4, "val_data": None, "sampling": {"temperature": 1.0, "max_tokens": 1},
        "max_prompt_length": 64, "max_response_length": 2, "algorithm": {"lr": 1e-4, "micro_batch_size": 8},
        "checkpoint": {"keep_last": 1, "log_every": 1_000_000}, "store_url": f"sqlite:///{workdir / 'store.db'}",
        "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}", "output_dir": str(workdir / "runs"),
    }  # fmt: skip


def role(process: psutil.Process, flow_pid: int) -> str:
    if process.pid == flow_pid:
        return "flow"
    command = " ".join(process.cmdline())
    return next((name for mark, name in ROLES.items() if mark in command), command[:40])


def completed(workdir: Path) -> int:
    latest = workdir / "runs" / "soak" / "checkpoints" / "latest"
    if not latest.is_file():
        return 0
    return int(latest.read_text().strip().removeprefix("step-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--at", default="10,100,300", help="iterations at which to read the processes' memory")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    marks = sorted(int(x) for x in args.at.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(fast_config(workdir, args.iterations)))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("PREFECT_API_URL", None)
    log = open(workdir / "train.log", "wb")  # noqa: SIM115
    flow = subprocess.Popen([sys.executable, "-m", "flows.train", str(config)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    readings: dict[int, dict[str, float]] = {}
    started = time.monotonic()
    try:
        for mark in marks:
            while completed(workdir) < mark:
                if flow.poll() is not None:
                    raise SystemExit(f"the run ended early (exit {flow.returncode}); see {workdir / 'train.log'}")
                time.sleep(0.2)
            family = [psutil.Process(flow.pid), *psutil.Process(flow.pid).children(recursive=True)]
            readings[mark] = {
                role(p, flow.pid): p.memory_info().rss / 2**20 for p in family if "(" not in role(p, flow.pid)
            }
            print(f"iteration {mark}: {time.monotonic() - started:.0f} s, " + ", ".join(
                f"{name} {mib:.1f} MiB" for name, mib in readings[mark].items()), flush=True)  # fmt: skip
        flow.wait(600)
    finally:
        if flow.poll() is None:
            flow.kill()
    print(f"\nResident memory (MiB) of a run's processes, {args.iterations} iterations of a fast config:\n")
    names = list(readings[marks[0]])
    after = marks[1] if len(marks) > 2 else marks[0]  # the first mark is the warm-up
    head = " | ".join(f"iteration {m}" for m in marks)
    print(f"| process | {head} | MiB per iteration, {after}-{marks[-1]} |")
    print("|---|" + "---|" * (len(marks) + 1))
    for name in names:
        values = [readings[m].get(name, float("nan")) for m in marks]
        first = marks.index(after)
        slope = (values[-1] - values[first]) / (marks[-1] - marks[first])
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {slope:+.3f} |")
    if args.json:
        args.json.write_text(json.dumps(readings, indent=2))


if __name__ == "__main__":
    main()
