"""Learning, measured: our GRPO loop and TRL's GRPOTrainer side by side on the same tiny model, task, warm start and
wall time, each with its own recipe; prints the held-out reward over time, the time until it first reaches 1.0 (or
the best reached), and seconds per optimiser step.

Our recipe is the demo's (examples/copy_task/demo.yaml: its algorithm, batch shape and dynamic sampling; `--recipe`
names another config, `--set` changes a field). TRL's is `--trl-*` (lr, batch shape, loss type, threads).

Our side is the whole product loop, `lightning.stages` on an open `Run`: rollouts through runners -> LLM proxy ->
embedded inference server, spans in a SQLite store, adapter -> TrainingBatch -> GRPO step in the trainer process ->
checkpoint -> weight reload. TRL's side generates in process (benchmarks/trl_grpo.py). Held-out evaluation (greedy, all
held-out prompts) is excluded from both training clocks.

    .venv/bin/python benchmarks/trainer_bench.py [--seconds 120] [--only ours|trl] [--repeat 3]

`--async-staleness 1` adds an `ours-async` row: our loop with `algorithm.max_staleness` 1, the next iteration's
rollouts running while the last one adapts, updates and checkpoints (docs/architecture.md, "Asynchronous RL").

With `--repeat N` the two sides take turns N times (seeds 0..N-1 for both) and the table gives each run and the
medians. Our side also prints where its steps went (mean ms per step: rollouts, adapting spans, the update, the
checkpoint with publishing the weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from examples.copy_task.agent import demonstrations, make_tasks  # noqa: E402
from examples.copy_task.data import split  # noqa: E402
from lightning import pipeline, reporting, stages  # noqa: E402
from lightning.algorithm.batch import TrainingBatch  # noqa: E402
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from lightning.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from lightning.config import load_config  # noqa: E402
from lightning.config_file import parse_overrides  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.run import Run  # noqa: E402

MAX_NEW_TOKENS = 5


def warm_start(model_dir: Path, tasks: list[dict], *, steps: int, lr: float, root: Path) -> Path:
    """A few supervised steps on demonstrations of some training prompts; both trainers start from it."""
    trainer = TorchTrainer(model_dir, TrainerConfig(lr=lr, kl_coef=0.0, micro_batch_size=64))
    batch = TrainingBatch.from_triplets(
        demonstrations(trainer.tokenizer, tasks),
        pad_token_id=trainer.tokenizer.pad_token_id,
        max_prompt_length=64,
        max_response_length=MAX_NEW_TOKENS + 1,
    )
    for _ in range(steps):
        loss = trainer.sft_step(batch)["sft_loss"]
    print(f"warm start: {steps} supervised steps on {len(tasks)} prompts, final loss {loss:.3f}", flush=True)
    return load_checkpoint(save_checkpoint(root, 0, trainer.model, trainer.tokenizer)).model_dir


@dataclass
class HeldOut:
    """One of our runs' held-out rewards over its training clock, evaluated every `eval_every_s` until `seconds`."""

    label: str
    seconds: float
    eval_every_s: float
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    last_eval: float | None = None
    time_to_one: float | None = None

    def due(self, clock: float) -> bool:
        return self.last_eval is None or clock - self.last_eval >= self.eval_every_s or clock >= self.seconds

    async def evaluate(self, run: Run, step: int, clock: float) -> bool:
        """The policy's greedy held-out reward now (outside the training clock), recorded and printed; whether
        training is over (the time is up, or the reward is 1.0)."""
        reward = (await stages.collect_rollouts(run, step, "val"))[1]["reward_mean"]
        self.curve.append((clock, step, reward))
        print(f"  {self.label}: {clock:6.1f}s step {step:4d} held-out reward {reward:.3f}", flush=True)
        self.last_eval = clock
        if reward >= 1.0 and self.time_to_one is None:
            self.time_to_one = clock
        return clock >= self.seconds or reward >= 1.0

    def result(self, steps: int, clock: float, parts: dict[str, float], rollouts: int) -> dict[str, Any]:
        """What `main` tabulates, with `parts` (seconds spent in each part of the steps) as mean ms per step and
        `rollouts` (run in all, dynamic sampling's refills included) as rollouts per step."""
        return {
            "curve": self.curve,
            "steps": steps,
            "rollouts_per_step": rollouts / max(steps, 1),
            "seconds_per_step": clock / max(steps, 1),
            "time_to_1.0": self.time_to_one,
            "best_heldout": max(r for _, _, r in self.curve),
            "ms_per_step": {name: 1000 * total / max(steps, 1) for name, total in parts.items()},
        }


async def run_ours(
    model_dir: Path,
    train_tasks: list[dict],
    heldout_tasks: list[dict],
    *,
    seconds: float,
    eval_every_s: float,
    workdir: Path,
    recipe: dict[str, Any],
    server: str = "process",
    task_runner: str = "default",
    runners: int = 1,
    seed: int = 0,
    track: bool = True,
) -> dict[str, Any]:
    """The product's loop through `lightning.stages` on an open `Run`: the trainer in its own process, every LLM
    call through the proxy; MLflow metrics (unless not `track`) and checkpoints as in `flows.train`. `recipe`:
    TrainConfig fields (the algorithm, batch_size, samples_per_task, dynamic sampling). MLflow traces are off: TRL's
    side logs nothing."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, tasks in (("train", train_tasks), ("val", heldout_tasks)):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    sampling = {"temperature": 1.0, "max_tokens": MAX_NEW_TOKENS}
    run_config = load_config(
        {
            "run_name": "bench", "model": str(model_dir), "agent": "examples.copy_task.agent:copy_agent",
            "train_data": str(workdir / "train.jsonl"), "val_data": str(workdir / "val.jsonl"), "n_runners": runners,
            "runner_concurrency": -(-256 // runners), "task_runner": task_runner, "sampling": sampling,
            "mlflow_traces": {"train_per_iteration": 0},
            "eval_sampling": {**sampling, "temperature": 0.0}, "max_prompt_length": 64,
            "max_response_length": MAX_NEW_TOKENS + 1, **recipe, "iterations": 100_000,
            "inference": {"in_process": server == "thread", "with_proxy": server == "with-proxy"},
            "proxy_in_process": server == "thread",
            "checkpoint": {"keep_last": 1, "log_to_mlflow": False}, "seed": seed,
            "store_url": f"sqlite:///{workdir}/store.db", "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
            "output_dir": str(workdir / "runs"),
        }
    )  # fmt: skip
    held_out = HeldOut("ours", seconds, eval_every_s)
    train_clock = 0.0
    step = rollouts_run = 0
    parts = {
        "rollouts": 0.0,
        "adapt": 0.0,
        "update": 0.0,
        "of which the trainer's step": 0.0,
        "checkpoint + publish": 0.0,
    }
    run = await Run.open(run_config, track=track)
    if run_config.algorithm.max_staleness:
        try:
            return await pipelined(run, seconds=seconds, eval_every_s=eval_every_s)
        finally:
            await run.close()
    try:
        while True:
            if held_out.due(train_clock) and await held_out.evaluate(run, step, train_clock):
                break
            started = time.perf_counter()
            ids, rollouts = await stages.collect_rollouts(run, step, "train")
            rollout_seconds = time.perf_counter() - started
            rollouts_run += len(ids)
            batch = await stages.adapt_spans(run, step, ids)
            adapted = time.perf_counter()
            metrics = await stages.ppo_step(run, step, batch["batch_path"])
            updated = time.perf_counter()
            await stages.checkpoint(run, step, reporting.iteration_row(step, rollouts, batch, metrics, rollout_seconds))
            ended = time.perf_counter()
            parts["rollouts"] += rollout_seconds
            parts["adapt"] += adapted - started - rollout_seconds
            parts["update"] += updated - adapted
            parts["of which the trainer's step"] += metrics.get("step_time_s", 0.0)
            parts["checkpoint + publish"] += ended - updated
            step += 1
            train_clock += ended - started
    finally:
        await run.close()
    return held_out.result(step, train_clock, parts, rollouts_run)


async def pipelined(run: Run, *, seconds: float, eval_every_s: float) -> dict[str, Any]:
    """`run_ours`'s loop with `algorithm.max_staleness` k >= 1, as `flows.train` runs it: iteration i's rollouts
    start once iteration i-1-k is done and the rollouts before them are in (`pipeline.wait_for_turn`), its update
    waits for the checkpoint before it (`pipeline.wait_for_checkpoint`). The iterations in flight finish before each
    evaluation, which the training clock leaves out. Its parts overlap: their mean ms per step add up to more than a
    step."""
    staleness = run.config.algorithm.max_staleness
    parts = {"rollouts": 0.0, "adapt": 0.0, "waiting for the update before": 0.0, "update": 0.0,
             "checkpoint + publish": 0.0}  # fmt: skip
    rollouts_run = 0

    async def iteration(step: int) -> None:
        nonlocal rollouts_run
        await pipeline.wait_for_turn(run, step)
        started = time.perf_counter()
        ids, rollouts = await stages.collect_rollouts(run, step, "train")
        rollout_seconds = time.perf_counter() - started
        rollouts_run += len(ids)
        batch = await stages.adapt_spans(run, step, ids)
        adapted = time.perf_counter()
        parts["waiting for the update before"] += await pipeline.wait_for_checkpoint(run, step)
        waited = time.perf_counter()
        metrics = await stages.ppo_step(run, step, batch["batch_path"])
        updated = time.perf_counter()
        await stages.checkpoint(run, step, reporting.iteration_row(step, rollouts, batch, metrics, rollout_seconds))
        parts["rollouts"] += rollout_seconds
        parts["adapt"] += adapted - started - rollout_seconds
        parts["update"] += updated - waited
        parts["checkpoint + publish"] += time.perf_counter() - updated

    held_out = HeldOut("ours-async", seconds, eval_every_s)
    in_flight: dict[int, asyncio.Task[None]] = {}
    train_clock, step = 0.0, 0
    resumed = time.perf_counter()
    try:
        while True:
            if held_out.due(train_clock + time.perf_counter() - resumed):
                for started in sorted(in_flight):
                    await in_flight.pop(started)
                train_clock += time.perf_counter() - resumed
                if await held_out.evaluate(run, step, train_clock):
                    break
                resumed = time.perf_counter()
            while len(in_flight) > staleness:
                await in_flight.pop(min(in_flight))
            in_flight[step] = asyncio.create_task(iteration(step))
            step += 1
            await asyncio.sleep(0)  # let it start before the clock is read again
    finally:
        for task in in_flight.values():
            task.cancel()
        await asyncio.gather(*in_flight.values(), return_exceptions=True)
    return held_out.result(step, train_clock, parts, rollouts_run)


RECIPE_FIELDS = (
    "algorithm",
    "batch_size",
    "samples_per_task",
    "dynamic_sampling",
    "max_sampling_rounds",
    "keep_failed_groups",
)


def our_recipe(path: Path, sets: list[str]) -> dict[str, Any]:
    """The recipe fields of a run config (the demo's by default), with `--set FIELD=VALUE` changes (YAML values)."""
    config = load_config(path, **parse_overrides(sets))
    return {field: getattr(config, field) for field in RECIPE_FIELDS} | {"algorithm": config.algorithm.model_dump()}


def changed(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe with the algorithm's fields left at their defaults left out."""
    defaults = TrainerConfig().model_dump()
    algorithm = {name: value for name, value in recipe["algorithm"].items() if value != defaults[name]}
    return {**recipe, "algorithm": algorithm}


def arguments() -> argparse.ArgumentParser:
    """The command line (gpu_check builds its parts' commands on it; tests/test_gpu_check.py checks them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120, help="training wall time for each side")
    parser.add_argument("--recipe", type=Path, default=REPO / "examples/copy_task/demo.yaml", help="our recipe")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a recipe field")
    parser.add_argument("--trl-prompts", type=int, default=16, help="TRL: prompts per optimiser step")
    parser.add_argument("--trl-generations", type=int, default=4, help="TRL: samples per prompt")
    parser.add_argument("--trl-lr", type=float, default=3e-4, help="TRL's (3e-4 is the recipe that reaches 1.0)")
    parser.add_argument("--trl-loss", default="dapo", help="TRL's loss_type (its default: dapo)")
    parser.add_argument(
        "--trl-threads", type=int, default=1,
        help="TRL's torch threads (ours: the trainer and the inference server take 1 each on 2 cores); 0: torch's",
    )  # fmt: skip
    parser.add_argument(
        "--server", choices=["with-proxy", "process", "thread"], default="with-proxy",
        help="our inference server: in a process with the proxy (the demo's), in one of its own, or on a thread",
    )  # fmt: skip
    parser.add_argument(
        "--task-runner", choices=["default", "processes"], default="default",
        help="our runners: on the loop's event loop, or in runner processes of the run (task_runner processes)",
    )  # fmt: skip
    parser.add_argument("--runners", type=int, default=1, help="our runner tasks (n_runners), 256 rollouts among them")
    parser.add_argument("--eval-every", type=float, default=5.0, help="seconds of training between evaluations")
    parser.add_argument("--only", choices=["ours", "ours-async", "trl"], default=None)
    parser.add_argument(
        "--async-staleness", type=int, default=0, metavar="K",
        help="add an ours-async row: our loop with algorithm.max_staleness K (rollouts overlap the update); 0: none",
    )  # fmt: skip
    parser.add_argument("--task", choices=["last", "copy"], default="last", help="examples/copy_task: which rule")
    parser.add_argument("--data", choices=["demo", "small"], default="demo", help="demo: examples/copy_task/data.py")
    parser.add_argument("--warm-steps", type=int, default=50, help="supervised warm-start steps (0: none)")
    parser.add_argument(
        "--warm-fraction", type=float, default=None,
        help="share of train prompts demonstrated (default: the demo's warm_start.fraction; --data small: 0.075)",
    )  # fmt: skip
    parser.add_argument("--warm-lr", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=MAX_NEW_TOKENS, help="tokens each answer may have")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side, taking turns (seeds 0..N-1)")
    parser.add_argument("--no-mlflow", action="store_true", help="our run without MLflow (Run.open(track=False))")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    load = MachineLoad()
    globals()["MAX_NEW_TOKENS"] = args.max_tokens

    workdir = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    model_dir = build_tiny_model(workdir / "tiny", seed=0)
    if args.data == "demo":  # the demo's training tasks and its 64 held-out
        if args.task != "last":
            parser.error("--data demo is the 'last' task; give --data small for --task copy")
        train_tasks, heldout_tasks = split()
        warm_fraction = load_config(REPO / "examples/copy_task/demo.yaml").warm_start.fraction
    else:  # the benchmark's tables before 2026-11-27: 64 training tasks, 32 held-out
        tasks = make_tasks(96, kind=args.task, seed=0)
        train_tasks, heldout_tasks = tasks[:64], tasks[64:]
        warm_fraction = 0.075
    if args.warm_steps:
        fraction = warm_fraction if args.warm_fraction is None else args.warm_fraction
        shown = train_tasks[: max(1, int(len(train_tasks) * fraction))]
        model_dir = warm_start(model_dir, shown, steps=args.warm_steps, lr=args.warm_lr, root=workdir / "warm")
    recipe = our_recipe(args.recipe, args.set)
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "ours-async": [], "trl": []}
    for seed in range(args.repeat):
        if args.only in (None, "ours"):
            results["ours"].append(
                asyncio.run(
                    run_ours(
                        model_dir, train_tasks, heldout_tasks, seconds=args.seconds, eval_every_s=args.eval_every,
                        workdir=workdir / f"ours-{seed}", server=args.server, task_runner=args.task_runner,
                        runners=args.runners, seed=seed, track=not args.no_mlflow,
                        recipe={**recipe, "algorithm": {**recipe["algorithm"], "seed": seed}},
                    )
                )
            )  # fmt: skip
        if args.async_staleness and args.only in (None, "ours-async"):
            algorithm = {**recipe["algorithm"], "seed": seed, "max_staleness": args.async_staleness}
            results["ours-async"].append(
                asyncio.run(
                    run_ours(
                        model_dir, train_tasks, heldout_tasks, seconds=args.seconds, eval_every_s=args.eval_every,
                        workdir=workdir / f"ours-async-{seed}", server=args.server, task_runner=args.task_runner,
                        runners=args.runners, seed=seed,
                        track=not args.no_mlflow, recipe={**recipe, "algorithm": algorithm},
                    )
                )
            )  # fmt: skip
        if args.only in (None, "trl"):
            from benchmarks.trl_grpo import run_trl

            results["trl"].append(
                run_trl(
                    model_dir, train_tasks, heldout_tasks, seconds=args.seconds, prompts_per_step=args.trl_prompts,
                    generations=args.trl_generations, lr=args.trl_lr, loss_type=args.trl_loss,
                    max_new_tokens=MAX_NEW_TOKENS,
                    eval_every_s=args.eval_every, seed=seed, output_dir=workdir / f"trl-{seed}",
                    threads=args.trl_threads or None,
                )
            )  # fmt: skip
    print(
        f"\nGRPO on the tiny model, {args.task!r} task ({len(train_tasks)} train / {len(heldout_tasks)} held-out), "
        f"{args.seconds:.0f} s each; ours: {args.recipe.name} {' '.join(args.set)} "
        f"({json.dumps(changed(recipe))}); TRL: "
        f"{args.trl_prompts} prompts x {args.trl_generations} samples, lr {args.trl_lr}, loss {args.trl_loss}, beta 0, "
        f"{args.trl_threads or 'default'} thread(s)"
    )
    print("| trainer | run | time to held-out 1.0 | best held-out | steps | s/step |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        for seed, r in enumerate(runs):
            reached = f"{r['time_to_1.0']:.1f} s" if r["time_to_1.0"] is not None else "not reached"
            row = f"{r['best_heldout']:.3f} | {r['steps']} | {r['seconds_per_step']:.3f}"
            print(f"| {name} | seed {seed} | {reached} | {row} |")
        if len(runs) > 1:
            # A run that never reached 1.0 counts as the whole budget (an upper bound on its time).
            times = [r["time_to_1.0"] if r["time_to_1.0"] is not None else args.seconds for r in runs]
            reached_all = all(r["time_to_1.0"] is not None for r in runs)
            median_time = f"{statistics.median(times):.1f} s" + (
                "" if reached_all else " (misses counted as the budget)"
            )
            best = statistics.median(r["best_heldout"] for r in runs)
            per_step = statistics.median(r["seconds_per_step"] for r in runs)
            print(f"| {name} | median of {len(runs)} | {median_time} | {best:.3f} | | {per_step:.3f} |")
    for name in ("ours", "ours-async"):
        if results[name]:
            parts = results[name][0]["ms_per_step"].keys()
            means = {part: statistics.mean(r["ms_per_step"][part] for r in results[name]) for part in parts}
            print(f"\n{name}: step, mean ms: " + ", ".join(f"{part} {ms:.0f}" for part, ms in means.items()))
            if "rollouts_per_step" in results[name][0]:
                per_step = statistics.mean(r["rollouts_per_step"] for r in results[name])
                print(f"{name}: {per_step:.0f} rollouts a step (the batch and dynamic sampling's refills)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
