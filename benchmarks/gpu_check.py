"""The project's GPU check: one command on a bare GPU machine that has torch (no network needed), under 9 minutes.

    make gpu-check                                   # = python3 benchmarks/gpu_check.py --out $OUT (or gpu-check-out)
    python3 benchmarks/gpu_check.py --small          # a dry run of every part at tiny sizes, on a CPU

Parts, in this order, each a process of its own with a time limit inside the budget (--budget, 510 s): a part that
fails or is cut off leaves what it printed, and the next one runs.

  env      Python, torch, transformers, TRL, the GPU and one bf16 matmul's TFLOP/s; that `lightning`, `examples`
           and `benchmarks` are this checkout's (a machine may have PyTorch Lightning installed as `lightning`)
  update   benchmarks/update_bench.py at issue 28's shape (a 0.47B Llama, 64 rows of 512 + 512 tokens): the plain
           torch step (micro-batches of 8) beside TorchTrainer.step's paths (micro-batches of 16 rows' tokens),
           full fine-tuning and LoRA (rank 16 on the attention and MLP projections)
  serving  benchmarks/serving_bench.py: the embedded server (bf16) against model.generate, 1, 16 and 64 requests
  loop     benchmarks/trainer_bench.py: our whole loop without MLflow (4 runner processes), the same with
           max_staleness 1, then TRL's GRPOTrainer, all on the GPU
  mixed    update_bench.py again on a batch of mixed lengths: padded rows against packed ones
  rollout  benchmarks/rollout_cpu.py with 4 runner processes: the rollout phase's CPU by process, and each one's
           cores busy (the process nearest one core bounds the phase); not in the default parts

The project's own requirements beyond torch and transformers (pydantic, SQLModel, FastAPI, TRL, ...) may be missing
there and there is no network: `make gpu-wheels` (on a machine with one) downloads them into .gpu-wheels/, carried
to the GPU machine with the checkout; when that folder is there this script installs them first, with pip
--no-index into a folder of its own on PYTHONPATH. Writes into --out: gpu-check.log (all that was printed), a JSON
per part, and summary.md: the tables for docs/benchmarks.md and issue 28's targets, each met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".gpu-wheels"
SITE = Path("/tmp/gpu-check-site")

FULL = {
    "update": (130, ["benchmarks/update_bench.py", "--size", "issue", "--lengths", "full", "--micro", "16",
                     "--plain-micro", "8", "--variants",
                     "plain,ours,lean,lean-kl,lean-ckpt,lean-bf16,lean-lora,lean-lora-kl,lean-ckpt-lora"]),
    "serving": (80, ["benchmarks/serving_bench.py", "--size", "issue", "--levels", "1,16,64", "--max-tokens", "64"]),
    "loop": (240, ["benchmarks/trainer_bench.py", "--seconds", "40", "--async-staleness", "1", "--no-mlflow",
                   "--task-runner", "processes", "--runners", "4"]),
    "mixed": (60, ["benchmarks/update_bench.py", "--size", "issue", "--lengths", "mixed", "--micro", "16",
                   "--plain-micro", "8", "--variants", "plain,ours,lean"]),
    "rollout": (120, ["benchmarks/rollout_cpu.py", "--iterations", "4", "--warmup", "1", "--no-floor",
                      "--no-mlflow", "--set", "n_runners=4", "--set", "runner_concurrency=64"]),
}  # fmt: skip
"""Each part's time limit (s) and command (a script of this checkout and its arguments; --json is added)."""
SMALL = {
    "update": (300, ["benchmarks/update_bench.py", "--variants", "plain,ours,lean,lean-kl,lean-lora", "--steps", "1",
                     "--warmup", "0"]),
    "serving": (200, ["benchmarks/serving_bench.py", "--levels", "1,4", "--max-tokens", "8"]),
    "loop": (400, ["benchmarks/trainer_bench.py", "--seconds", "8", "--data", "small", "--set", "batch_size=8",
                   "--set", "samples_per_task=2", "--trl-prompts", "8", "--trl-generations", "2", "--warm-steps", "2",
                   "--eval-every", "4", "--async-staleness", "1", "--no-mlflow", "--task-runner", "processes",
                   "--runners", "2"]),
    "mixed": (300, ["benchmarks/update_bench.py", "--variants", "ours,packed", "--steps", "1", "--warmup", "0"]),
    "rollout": (300, ["benchmarks/rollout_cpu.py", "--iterations", "1", "--warmup", "1", "--rollouts", "64",
                      "--no-floor", "--no-mlflow", "--set", "n_runners=2", "--set", "runner_concurrency=32"]),
}  # fmt: skip

TARGETS = (
    "issue 28's targets at its shape, without KL: ours (lean) at least as fast as plain (ratio >= 1.0) and >= 35% MFU; "
    "peak memory <= 16 GiB at micro-batch 16; with KL (lean-kl) <= 1.3x the step without"
)


def environment() -> None:
    """The env part, in a process of its own: what the checks run on."""
    import importlib
    import importlib.metadata as metadata

    print(f"python {platform.python_version()} at {sys.executable}; {os.cpu_count()} CPUs")
    for name in ("torch", "transformers", "trl", "datasets", "pydantic", "sqlmodel", "fastapi", "uvicorn", "openai",
                 "opentelemetry-sdk", "mlflow", "prefect", "lightning", "pytorch-lightning"):  # fmt: skip
        try:
            print(f"  {name:28s} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"  {name:28s} -")
    failed = []
    for name in ("lightning.run", "lightning.stages", "lightning.algorithm.trainer", "lightning.inference.server",
                 "lightning.proxy", "examples.copy_task.agent", "benchmarks.trl_grpo"):  # fmt: skip
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (reported: the parts that need it will fail)
            failed.append(name)
            print(f"  import {name}: FAILED {type(exc).__name__}: {exc}")
            continue
        where = Path(getattr(module, "__file__", "") or "")
        ours = REPO in where.parents
        print(f"  import {name}: {'ok' if ours else 'NOT THIS CHECKOUT: ' + str(where)}")
        if not ours:
            failed.append(name)
    import torch

    print(f"torch sees a GPU: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}, "
              f"CUDA {torch.version.cuda}")  # fmt: skip
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        print(f"bf16 matmul 8192^3: {2 * 8192**3 * 10 / (time.perf_counter() - began) / 1e12:.0f} TFLOP/s")
    print(f"imports failed: {len(failed)}")


def install_wheels(log: Any) -> dict[str, str]:
    """The carried wheels that the machine lacks, or has older, into SITE (pip, no index, no dependencies); the
    environment the parts run in: this checkout first on PYTHONPATH, then SITE, then the machine's packages."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    paths = [str(REPO)]
    wheels = [wheel for wheel in sorted(WHEELS.glob("*.whl")) if needed(wheel)]
    if wheels:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                   "--upgrade", "--target", str(SITE), *map(str, wheels)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        names = " ".join(wheel.name.split("-")[0] + "==" + wheel.name.split("-")[1] for wheel in wheels)
        say(log, f"== wheels into {SITE}: exit {done.returncode}: {names} {done.stderr[-2000:]}")
        paths.append(str(SITE))
    else:
        say(log, f"== wheels: none needed from {WHEELS} (`make gpu-wheels` makes them where there is a network)")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def needed(wheel: Path) -> bool:
    """Whether the machine lacks the wheel's distribution or has an older version of it."""
    import importlib.metadata as metadata

    name, version = wheel.name.split("-")[:2]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return True
    try:
        from packaging.version import Version

        return Version(installed) < Version(version)
    except Exception:  # noqa: BLE001  (no packaging, or a version it cannot parse: keep the machine's)
        return False


def say(log: Any, line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def run_part(name: str, limit: float, command: list[str], env: dict[str, str], log: Any) -> dict[str, Any]:
    """Run one part under `limit` seconds (then its whole process group is killed), its output into the log as it
    comes; its status and the table lines it printed."""
    say(log, f"\n== {name}: {shlex.join(command)} (limit {limit:.0f} s)")
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, *command], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    table: list[str] = []

    def relay() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            say(log, line.rstrip("\n"))
            if line.startswith("|"):
                table.append(line.rstrip("\n"))

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        process.wait(timeout=limit)
        status = "ok" if process.returncode == 0 else f"exit {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = f"cut off at its limit of {limit:.0f} s"
    reader.join(timeout=10)
    took = round(time.monotonic() - began)
    say(log, f"== {name}: {status} after {took} s")
    return {"status": status, "seconds": took, "table": table}


def targets(update: dict[str, Any]) -> list[str]:
    """Issue 28's targets on the update part's results, each met or missed (or not measured)."""
    found = {r["variant"]: r for r in update.get("results", []) if "step_s" in r}
    lines = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    plain, lean, kl = found.get("plain"), found.get("lean"), found.get("lean-kl")
    if plain and lean:
        ratio = plain["step_s"] / lean["step_s"]
        lines.append(f"- lean vs plain: {ratio:.2f}x the plain step's speed (target >= 1.0): {verdict(ratio >= 1.0)}")
    for name in ("lean", "lean-ckpt", "lean-bf16"):
        row = found.get(name)
        if row and row.get("mfu") is not None:
            lines.append(f"- {name} MFU {row['mfu']:.1%} (target >= 35%): {verdict(row['mfu'] >= 0.35)}")
        if row and row.get("peak_gib") is not None:
            lines.append(f"- {name} peak {row['peak_gib']:.1f} GiB (target <= 16): {verdict(row['peak_gib'] <= 16)}")
    if lean and kl:
        cost = kl["step_s"] / lean["step_s"]
        lines.append(f"- lean-kl / lean: {cost:.2f}x (target <= 1.3): {verdict(cost <= 1.3)}")
    return lines or ["- not measured (the update part left no results)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "gpu-check-out"))
    parser.add_argument("--budget", type=float, default=None, help="seconds for all parts (510; --small: 1500)")
    parser.add_argument("--parts", default="env,update,serving,loop,mixed")
    parser.add_argument("--small", action="store_true", help="tiny sizes and short times: a dry run on a CPU")
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)  # the env part's own process
    args = parser.parse_args()
    if args.env:
        sys.path.insert(0, str(REPO))
        environment()
        return
    budget = args.budget or (1500 if args.small else 510)
    parts = FULL if not args.small else SMALL
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with open(args.out / "gpu-check.log", "w") as log:
        say(log, f"== GPU check of {REPO} at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()[0]:.2f}, "
                 f"budget {budget:.0f} s{', small' if args.small else ''}")  # fmt: skip
        env = install_wheels(log)
        for name in args.parts.split(","):
            left = budget - (time.monotonic() - started)
            if name == "env":
                results[name] = run_part(name, min(60, left), ["benchmarks/gpu_check.py", "--env"], env, log)
                continue
            limit, command = parts[name]
            if left < 20:
                say(log, f"\n== {name}: SKIPPED, {left:.0f} s of the budget left")
                results[name] = {"status": "skipped", "table": []}
                continue
            command = [*command, "--json", str(args.out / f"{name}.json")]
            results[name] = run_part(name, min(limit, left), command, env, log)
        written = {name: json.loads((args.out / f"{name}.json").read_text()) for name in ("update", "serving")
                   if (args.out / f"{name}.json").exists()}  # fmt: skip
        update = written.get("update", {})
        device = next((part["device"] for part in written.values() if "device" in part), "?")
        summary = [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}", "", f"Device: {device}", ""]
        for name, result in results.items():
            summary += [f"## {name}: {result['status']} ({result.get('seconds', 0)} s)", "", *result["table"], ""]
        summary += [f"## targets ({TARGETS})", "", *targets(update), ""]
        summary.append(f"All parts: {time.monotonic() - started:.0f} s of a {budget:.0f} s budget.")
        (args.out / "summary.md").write_text("\n".join(summary) + "\n")
        say(log, "\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
