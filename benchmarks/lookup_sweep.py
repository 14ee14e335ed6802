"""Recipes for the multi-turn example, side by side over seeds: benchmarks/lookup_lab.py once per (recipe, seed), as
parallel processes (one CPU thread each; on a GPU machine they share the GPU), then a table of each recipe's held-out
reward after the warm start and at the end, its tool use, and the spread over seeds.

    .venv/bin/python benchmarks/lookup_sweep.py --parallel 2 --seeds 0 1 2                  # on this machine
    python3 benchmarks/lookup_sweep.py --device cuda --parallel 16 --out $OUT                # on a lent GPU machine

A recipe is a name and lookup_lab.py's arguments (RECIPES below). On a GPU machine the wheels that
benchmarks/gpu_check.py carries (.gpu-wheels, `make gpu-wheels`) are installed first, as it does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RECIPES: dict[str, list[str]] = {
    "example": [],  # examples/lookup/train.yaml as it is
    "lr3e-4": ["--set", "lr=3e-4"],
    "lr1e-3": ["--set", "lr=1e-3"],
    "lr3e-4-ep4": ["--set", "lr=3e-4", "--set", "ppo_epochs=4"],
    "wide-lr3e-4": ["--hidden", "128", "--layers", "4", "--warm-lr", "1e-3", "--set", "lr=3e-4"],
}


def one(name: str, seed: int, args: argparse.Namespace, env: dict[str, str] | None) -> dict:
    out = args.out / f"{name}-s{seed}.json"
    command = [sys.executable, str(REPO / "benchmarks/lookup_lab.py"), "--seeds", str(seed), "--device", args.device,
               "--json", str(out), *args.extra, *RECIPES[name]]  # fmt: skip
    started = time.perf_counter()
    log = args.out / f"{name}-s{seed}.log"
    with open(log, "w") as stream:  # written as it goes: a run cut off by the timeout leaves its progress
        try:
            returncode = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=env,
                                        timeout=args.timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            returncode = -1
    print(f"{name} seed {seed}: exit {returncode} in {time.perf_counter() - started:.0f} s", flush=True)
    if returncode or not out.is_file():
        return {"recipe": name, "seed": seed, "error": log.read_text()[-500:]}
    [run] = json.loads(out.read_text())["runs"]
    return {"recipe": name, "seed": seed, "curve": run["curve"], "seconds": run["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    parser.add_argument("--out", type=Path, default=Path("lookup-sweep-out"))
    parser.add_argument("extra", nargs="*", help="more lookup_lab.py arguments for every run (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = None
    if args.device != "cpu":  # a GPU machine: the carried wheels first, as gpu_check does
        sys.path.insert(0, str(REPO / "benchmarks"))
        from gpu_check import install_wheels

        with open(args.out / "wheels.log", "w") as log:
            env = install_wheels(log)
    jobs = [(name, seed) for seed in args.seeds for name in args.recipes]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: one(*job, args, env), jobs))
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
    print("| recipe | seeds | warm start | final (each seed) | final median [min, max] | tool use at the end | s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.recipes:
        done = [r for r in results if r["recipe"] == name and "curve" in r]
        if not done:
            print(f"| {name} | failed: {[r.get('error', '')[-120:] for r in results if r['recipe'] == name][:1]} |")
            continue
        warm = [r["curve"][0][1]["reward"] for r in done]
        final = [r["curve"][-1][1]["reward"] for r in done]
        tools = [r["curve"][-1][1]["tool_use"] for r in done]
        print(
            f"| {name} | {len(done)} | {statistics.median(warm):.3f} | {' '.join(f'{v:.3f}' for v in final)} | "
            f"{statistics.median(final):.3f} [{min(final):.3f}, {max(final):.3f}] | {statistics.median(tools):.2f} | "
            f"{statistics.median(r['seconds'] for r in done):.0f} |"
        )


if __name__ == "__main__":
    main()
