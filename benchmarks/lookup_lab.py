"""The multi-turn example's recipe alone, in one process, over seeds: examples/lookup's agent (look a key up with the
`lookup` tool, once or twice, then answer) rolled out with `model.generate` turn by turn, its tool run in process and
each conversation joined token-exactly as the LLM proxy joins it (`lightning.chat.continue_conversation`: the same
bridge ids, masked out of the loss); the warm start on the example's demonstrations; GRPO updates by the product's
`TorchTrainer` on trajectory rows; greedy held-out accuracy, tool use and turns. No store, proxy or server, so
recipes compare over seeds in minutes, as benchmarks/recipe_lab.py does for the demo. `make lookup` runs the product.

    .venv/bin/python benchmarks/lookup_lab.py --seeds 0 1 2 --warm-steps 150 --set lr=1e-4

`--set` changes a TrainerConfig field (JSON value) of the example's `algorithm:` section; `--device cuda` runs it on
a GPU. Each seed sets the tiny model's weights, the task order and the sampling, as a run's `seed` does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import recipe_lab  # noqa: E402  (benchmarks/, this script's folder)
import torch  # noqa: E402
import yaml  # noqa: E402

from examples.lookup.agent import (  # noqa: E402
    HASTY_FOLLOW_SHARE,
    LOOKUP_TOOL,
    MAX_TURNS,
    demonstrations,
    make_tasks,
    run_tool,
    table,
)
from examples.lookup.data import HELD_OUT, TRAIN  # noqa: E402
from lightning.algorithm.batch import TrainingBatch  # noqa: E402
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from lightning.chat import NotAContinuation, continue_conversation, render_ids  # noqa: E402
from lightning.config import TinyModel, WarmStart  # noqa: E402
from lightning.inference.tools import split_tool_calls  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.types import Triplet  # noqa: E402

RECIPE = yaml.safe_load((REPO / "examples/lookup/train.yaml").read_text())
MAX_PROMPT, MAX_RESPONSE = RECIPE["max_prompt_length"], RECIPE["max_response_length"]
TINY = TinyModel(**RECIPE.get("tiny_model", {}))
"""The tiny model the example's run builds (`tiny_model:`), its defaults included."""


def generate(model: Any, tokenizer: Any, contexts: list[list[int]], *, greedy: bool, seed: int) -> list[list[int]]:
    """Each context's next turn: its token ids up to and with the first end token (or max_tokens of them)."""
    sampling = RECIPE["eval_sampling"] if greedy else RECIPE["sampling"]
    turns, _ = recipe_lab.generate(
        model, tokenizer, contexts, greedy=greedy, max_tokens=sampling["max_tokens"], seed=seed,
        temperature=sampling.get("temperature", 1.0),
    )  # fmt: skip
    return turns


def roll_out(model: Any, tokenizer: Any, tasks: list[dict[str, Any]], *, greedy: bool, seed: int) -> list[dict]:
    """The agent's conversations, all tasks' turns generated together: per task its prompt ids, the response ids
    (turns and bridges joined), the mask (1: generated), the reward, its turns and tool calls."""
    states = []
    for task in tasks:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["key"]}]
        prompt = render_ids(tokenizer, messages, tools=[LOOKUP_TOOL], add_generation_prompt=True)
        states.append({"task": task, "messages": messages, "prompt": prompt, "response": [], "mask": [], "answer": "",
                       "turns": 0, "calls": 0})  # fmt: skip
    active = list(range(len(states)))
    for turn in range(MAX_TURNS):
        if not active:
            break
        contexts = [states[i]["prompt"] + states[i]["response"] for i in active]
        outputs = generate(model, tokenizer, contexts, greedy=greedy, seed=seed * 7919 + turn)
        still = []
        for i, ids in zip(active, outputs, strict=True):
            state = states[i]
            state["turns"] += 1
            state["response"] += ids
            state["mask"] += [1] * len(ids)
            content, calls = split_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
            if not calls:
                state["answer"] = content
                continue
            assistant = {"role": "assistant", "content": content or None,
                         "tool_calls": [call.model_dump() for call in calls]}  # fmt: skip
            entries = table(state["task"]["table"])
            results = [
                {"role": "tool", "tool_call_id": call.id,
                 "content": run_tool(entries, call.function.name, call.function.arguments)}
                for call in calls
            ]  # fmt: skip
            try:
                bridge = continue_conversation(
                    tokenizer, state["messages"] + [assistant], results, tools=[LOOKUP_TOOL], last=ids[-1]
                )
            except NotAContinuation:  # cut off by max_tokens: the agent would get no answer
                continue
            state["messages"] += [assistant, *results]
            state["calls"] += len(calls)
            state["response"] += bridge
            state["mask"] += [0] * len(bridge)
            still.append(i)
        active = still
    for state in states:
        state["reward"] = 1.0 if state["answer"].strip() == state["task"]["value"] else 0.0
    return states


def held_out(trainer: TorchTrainer, tasks: list[dict[str, Any]]) -> dict[str, float]:
    states = roll_out(trainer.model, trainer.tokenizer, tasks, greedy=True, seed=0)
    return {
        "reward": statistics.mean(s["reward"] for s in states),
        "tool_use": statistics.mean(s["calls"] > 0 for s in states),
        "turns": statistics.mean(s["turns"] for s in states),
        **{
            f"{calls}-call": statistics.mean(s["reward"] for s in states if s["task"]["calls"] == calls)
            for calls in (1, 2)
        },
    }


def trajectory_rows(states: list[dict]) -> list[Triplet]:
    """One row per conversation (the `trajectory` shape): its turns and bridges, only the generated ids trained."""
    return [
        Triplet(
            prompt=s["prompt"],
            response=s["response"],
            reward=s["reward"],
            response_mask=s["mask"],
            metadata={"group_id": str(s["group"]), "rollout_id": str(k)},
        )  # fmt: skip
        for k, s in enumerate(states)
    ]


def run(seed: int, args: argparse.Namespace, config: TrainerConfig, model_dir: Path) -> dict[str, Any]:
    """One seed: the warm start, then `iterations` of roll out -> reward -> (keep groups that differ) -> update."""
    trainer = TorchTrainer(model_dir, config.model_copy(update={"seed": seed}), device=args.device)
    tokenizer, pad = trainer.tokenizer, trainer.tokenizer.pad_token_id
    balanced = args.balanced_keys  # the example's data (examples/lookup/data.py), or its keys in shuffled rounds
    train = make_tasks(TRAIN, first_table=0, seed=0, balanced_keys=balanced)
    val = make_tasks(HELD_OUT, first_table=1_000_000, seed=1, balanced_keys=balanced)
    shown = train[: int(len(train) * args.warm_fraction)]
    if args.two_call_share is not None:  # RL's tasks: this share of two-call ones (the held-out mix stays)
        rest = train[len(shown) :]
        two_calls, one_calls = [t for t in rest if t["calls"] == 2], [t for t in rest if t["calls"] == 1]
        ones = round(len(two_calls) * (1 - args.two_call_share) / args.two_call_share)
        train = two_calls + one_calls[:ones]
        print(f"seed {seed}: RL on {len(train)} tasks, {len(two_calls)} of them two-call", flush=True)
    two = [t for t in shown if t["calls"] == 2]
    if not args.run_order:  # one-call demonstrations first (the tables up to 2026-11-30 were measured so)
        shown = [t for t in shown if t["calls"] == 1] + two[: round(len(two) * args.two_call_demos)]
    two_call = sum(t["calls"] == 2 for t in shown)
    print(f"seed {seed}: {len(shown)} demonstrations, {two_call} of them two-call", flush=True)
    rows = demonstrations(tokenizer, shown, follow_share=args.follow_share)
    warm = TrainingBatch.from_triplets(
        rows, pad_token_id=pad, max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE
    )
    started = time.perf_counter()
    sample = random.Random(f"warm/{seed}")
    schedule = WarmStart(**{**RECIPE["warm_start"], "steps": args.warm_steps, "lr_schedule": args.warm_schedule})
    for step in range(args.warm_steps):
        if args.warm_batch:  # a step on a random share of the demonstrations, not all of them
            warm = TrainingBatch.from_triplets(
                sample.sample(rows, args.warm_batch), pad_token_id=pad, max_prompt_length=MAX_PROMPT,
                max_response_length=MAX_RESPONSE,
            )  # fmt: skip
        loss = trainer.sft_step(warm, lr=schedule.step_lr(step, args.warm_lr))["sft_loss"]
        if args.warm_stop_at_loss is not None and loss <= args.warm_stop_at_loss:
            print(f"seed {seed}: the demonstrations are fit at warm step {step + 1} (sft_loss {loss:.4f})", flush=True)
            break
        if args.warm_eval_every and (step + 1) % args.warm_eval_every == 0 and step + 1 < args.warm_steps:
            print(f"seed {seed}: warm step {step + 1} (sft_loss {loss:.4f}): {held_out(trainer, val)}", flush=True)
    trainer.start_rl()  # as a run does: RL starts with a fresh optimizer
    curve = [(0, held_out(trainer, val))]
    print(f"seed {seed}: warm start {curve[0][1]} ({time.perf_counter() - started:.0f} s)", flush=True)
    for iteration in range(args.iterations):
        rng = random.Random(f"{seed}/{iteration}")
        tasks = rng.sample(train, args.batch * args.oversample)
        states = roll_out(trainer.model, tokenizer, [t for t in tasks for _ in range(args.samples)], greedy=False,
                          seed=seed * 100_003 + iteration)  # fmt: skip
        for k, state in enumerate(states):
            state["group"] = k // args.samples
        triplets = trajectory_rows(states)
        if args.oversample > 1:
            from lightning.stages import informative_groups  # the run's whole machinery: only when asked for

            triplets, _ = informative_groups(triplets, args.batch)
        batch = TrainingBatch.from_triplets(
            triplets, pad_token_id=pad, max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE
        )
        metrics = trainer.step(batch)
        if args.trace:
            share = statistics.mean(s["calls"] > 0 for s in states)
            print(f"  {iteration}: reward {statistics.mean(s['reward'] for s in states):.3f} tool use {share:.2f} "
                  f"entropy {metrics.get('entropy', float('nan')):.3f}", flush=True)  # fmt: skip
        if (iteration + 1) % args.eval_every == 0 or iteration + 1 == args.iterations:
            curve.append((iteration + 1, held_out(trainer, val)))
            print(f"seed {seed}: iteration {iteration + 1}: {curve[-1][1]}", flush=True)
    if args.show:
        states = roll_out(trainer.model, tokenizer, val, greedy=True, seed=0)
        for state in [s for s in states if not s["reward"]][: args.show]:
            print(f"  failed {state['task']}: {tokenizer.decode(state['response'])!r}", flush=True)
    return {"seed": seed, "curve": curve, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=RECIPE["iterations"])
    parser.add_argument("--batch", type=int, default=RECIPE["batch_size"], help="tasks per update")
    parser.add_argument("--samples", type=int, default=RECIPE["samples_per_task"], help="samples per task")
    parser.add_argument("--oversample", type=int, default=1, help="dynamic sampling: roll out K times the tasks")
    parser.add_argument("--hidden", type=int, default=TINY.hidden_size, help="the tiny model's hidden size")
    parser.add_argument("--layers", type=int, default=TINY.num_layers, help="the tiny model's layers")
    parser.add_argument("--heads", type=int, default=2, help="the tiny model's attention heads")
    parser.add_argument("--init-std", type=float, default=TINY.init_std, help="the tiny model's initial weights' std")
    parser.add_argument("--warm-steps", type=int, default=RECIPE["warm_start"]["steps"])
    parser.add_argument("--warm-lr", type=float, default=RECIPE["warm_start"]["lr"])
    parser.add_argument("--warm-fraction", type=float, default=RECIPE["warm_start"]["fraction"])
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--balanced-keys", action="store_true", help="tasks' keys in shuffled rounds of all eight")
    parser.add_argument(
        "--warm-schedule", default=RECIPE["warm_start"].get("lr_schedule", "constant"), choices=["constant", "cosine"]
    )
    parser.add_argument(
        "--warm-stop-at-loss", type=float, default=RECIPE["warm_start"].get("stop_at_loss"),
        help="end the warm start at the first step with sft_loss this low or lower",
    )  # fmt: skip
    parser.add_argument("--warm-batch", type=int, default=0, help="demonstrations a warm-start step (0: all)")
    parser.add_argument(
        "--run-order", action="store_true",
        help="the demonstrations in the dataset's order, as a run has them: with --warm-batch, a run's very draws",
    )  # fmt: skip
    parser.add_argument("--warm-eval-every", type=int, default=0, help="held-out every N warm-start steps")
    parser.add_argument("--show", type=int, default=0, help="print N failed held-out conversations at the end")
    parser.add_argument("--two-call-demos", type=float, default=1.0, help="share of two-call demonstrations kept")
    parser.add_argument(
        "--follow-share", type=float, default=HASTY_FOLLOW_SHARE,
        help="share of the two-call demonstrations that follow the pointer (default: the example's hasty demonstrator)",
    )  # fmt: skip
    parser.add_argument("--two-call-share", type=float, default=None, help="share of two-call tasks in RL's batches")
    parser.add_argument(
        "--default-tokenizer", action="store_true",
        help="the tiny tokenizer without the example's tokenizer_corpus (the tool call in 44 tokens instead of 24)",
    )  # fmt: skip
    parser.add_argument("--set", action="append", default=[], help="a TrainerConfig field as JSON, e.g. lr=1e-4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--trace", action="store_true", help="print each iteration's training reward and tool use")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # total_steps and the scoring temperature as a run sets them.
    run_sets = {"total_steps": max(1, args.iterations), "temperature": RECIPE["sampling"]["temperature"]}
    fields = recipe_lab.with_overrides({**RECIPE["algorithm"], **run_sets}, args.set)
    config = TrainerConfig(**fields)
    with tempfile.TemporaryDirectory() as tmp:
        size: dict[str, Any] = {
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "init_std": args.init_std,
            "num_heads": args.heads,
        }
        if not args.default_tokenizer:
            size["extra_corpus"] = TINY.tokenizer_corpus
        results = [
            run(seed, args, config, build_tiny_model(Path(tmp) / f"tiny-{seed}", seed=seed, **size))
            for seed in args.seeds
        ]
    print(f"recipe: {fields}, {args.batch} tasks x {args.samples} samples, warm {args.warm_steps} x {args.warm_lr}")
    for result in results:
        curve = " ".join(f"{value['reward']:.2f}/{value['tool_use']:.2f}" for _, value in result["curve"])
        print(f"seed {result['seed']}: held-out reward/tool use {curve} | {result['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"recipe": fields, "args": vars(args) | {"json": None}, "runs": results}))


if __name__ == "__main__":
    main()
