"""The RL recipe alone, in one process, over many seeds: the demo's task, data, warm start and batch shape, sampled with
`model.generate` instead of the pipeline (no store, proxy or inference server), so recipes (learning rate, epochs,
mini-batches, entropy bonus, dynamic sampling, schedules) compare over seeds in minutes. It is how the demo's recipe
was chosen (docs/benchmarks.md, "Learning that holds"); `make demo` and `trainer_bench.py` run the whole product.

    .venv/bin/python benchmarks/recipe_lab.py --seeds 0 1 2 3 4 --set lr=8e-4 --set ppo_epochs=4 --oversample 3

As a run's `seed` does, each seed sets the tiny model's initial weights, the task order and the sampling. The update
is the product's `TorchTrainer`; `--oversample K` samples K times the batch's tasks and keeps the first `--batch`
groups whose rewards differ (`lightning.stages.informative_groups`: the product's dynamic sampling, which samples
only as many more as it needs). `--keep-failed K` keeps up to K groups that all failed besides (the product's
`keep_failed_groups`), for `--set failed_group_advantage=-1.0` to push their answers down. Held-out reward is
greedy on the demo's 64 held-out tasks.
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

import torch  # noqa: E402

from examples.copy_task.agent import demonstrations, reward  # noqa: E402
from examples.copy_task.data import TRAIN, split  # noqa: E402
from lightning.algorithm.batch import TrainingBatch  # noqa: E402
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.stages import informative_groups  # noqa: E402
from lightning.types import Triplet  # noqa: E402

MAX_PROMPT, MAX_RESPONSE = 64, 4


def prompt_ids(tokenizer: Any, task: dict[str, Any]) -> list[int]:
    messages = [{"role": "user", "content": task["letters"]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    greedy: bool,
    max_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> tuple[list[list[int]], list[str]]:
    """Each prompt's response token ids (up to and with the first end token) and its text."""
    length = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts], device=model.device)
    attention = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=not greedy, max_new_tokens=max_tokens,
        temperature=None if greedy else temperature, top_p=None, top_k=None, pad_token_id=pad,
    )  # fmt: skip
    ends = set(model.generation_config.eos_token_id)
    responses = []
    for row in out[:, length:].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), len(row) - 1)
        responses.append(row[: end + 1])
    return responses, [tokenizer.decode(r, skip_special_tokens=True) for r in responses]


def held_out(trainer: TorchTrainer, tasks: list[dict[str, Any]], max_tokens: int, show: bool) -> float:
    """Mean reward of greedy answers; with `show`, the wrong ones are printed (`letters>answer`)."""
    prompts = [prompt_ids(trainer.tokenizer, t) for t in tasks]
    _, texts = generate(trainer.model, trainer.tokenizer, prompts, greedy=True, max_tokens=max_tokens, seed=0)
    if show:
        pairs = zip(texts, tasks, strict=True)
        wrong = [f"{t['letters']}>{text.strip()}" for text, t in pairs if text.strip() != t["target"]]
        print(f"      {len(wrong)} of {len(tasks)} held-out answers wrong: {' '.join(wrong)}")
    return sum(reward(text, t["target"]) for text, t in zip(texts, tasks, strict=True)) / len(tasks)


def with_overrides(fields: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """`fields` with each `--set name=JSON` item applied (a TrainerConfig field each)."""
    for item in items:
        name, _, value = item.partition("=")
        fields = {**fields, name: json.loads(value)}
    return fields


def run(seed: int, args: argparse.Namespace, config: TrainerConfig, model_dir: Path) -> dict[str, Any]:
    """One seed: the warm start, then `iterations` of sample -> reward -> (filter) -> update; the held-out curve."""
    trainer = TorchTrainer(model_dir, config.model_copy(update={"seed": seed}), device="cpu")
    tokenizer = trainer.tokenizer
    train, val = split(args.train)
    shown = train[: int(len(train) * args.warm_fraction)]
    warm = TrainingBatch.from_triplets(
        demonstrations(tokenizer, shown), pad_token_id=tokenizer.pad_token_id, max_prompt_length=MAX_PROMPT,
        max_response_length=MAX_RESPONSE,
    )  # fmt: skip
    for _ in range(args.warm_steps):
        trainer.sft_step(warm, lr=args.warm_lr)
    if not args.keep_optimizer:  # as a run does: RL starts with a fresh optimizer
        trainer.start_rl()
    curve = [(0, held_out(trainer, val, args.max_tokens, args.answers))]
    rows = []
    started = time.perf_counter()
    for iteration in range(args.iterations):
        order = list(range(len(train)))
        random.Random(f"{seed}/{iteration}").shuffle(order)
        tasks = [train[i] for i in order[: args.batch * args.oversample]]
        prompts = [prompt_ids(tokenizer, t) for t in tasks for _ in range(args.samples)]
        sample_seed = seed * 100_003 + iteration
        responses, texts = generate(
            trainer.model,
            tokenizer,
            prompts,
            greedy=False,
            max_tokens=args.max_tokens,
            seed=sample_seed,
            temperature=config.scoring_temperature,  # the trainer's log-probs are at the same temperature
        )
        triplets = [
            Triplet(
                prompt=prompt,
                response=response,
                reward=reward(text, tasks[k // args.samples]["target"]),
                metadata={"group_id": str(k // args.samples), "rollout_id": str(k)},
            )  # fmt: skip
            for k, (prompt, response, text) in enumerate(zip(prompts, responses, texts, strict=True))
        ]
        if args.oversample > 1:
            triplets, _ = informative_groups(triplets, args.batch, args.keep_failed)
        batch = TrainingBatch.from_triplets(
            triplets, pad_token_id=tokenizer.pad_token_id, max_prompt_length=MAX_PROMPT,
            max_response_length=MAX_RESPONSE,
        )  # fmt: skip
        rows.append({"iteration": iteration, **trainer.step(batch)})
        if (iteration + 1) % args.eval_every == 0 or iteration + 1 == args.iterations:
            curve.append((iteration + 1, held_out(trainer, val, args.max_tokens, args.answers)))
    keys = ["reward_mean", "entropy", "zero_std_group_fraction", "clip_frac", "grad_norm", "response_length_mean"]
    return {
        "seed": seed,
        "curve": curve,
        "final": curve[-1][1],
        "best": max(value for _, value in curve),
        "updates_to_one": next((iteration for iteration, value in curve if value >= 1.0), None),
        "seconds": time.perf_counter() - started,
        "trace": [{key: round(row.get(key, float("nan")), 3) for key in ["iteration", *keys]} for row in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="tasks per update")
    parser.add_argument("--samples", type=int, default=8, help="samples per task")
    parser.add_argument("--oversample", type=int, default=1, help="dynamic sampling: sample K times the tasks")
    parser.add_argument(
        "--keep-failed", type=int, default=0,
        help="dynamic sampling: all-failed groups kept besides (keep_failed_groups; --set failed_group_advantage)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="the tiny model's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="the tiny model's layers")
    parser.add_argument("--warm-steps", type=int, default=30)
    parser.add_argument("--warm-lr", type=float, default=1e-3)
    parser.add_argument("--train", type=int, default=TRAIN, help="training tasks; the held-out ones stay the same")
    parser.add_argument("--warm-fraction", type=float, default=0.0143, help="share of the training tasks demonstrated")
    parser.add_argument("--keep-optimizer", action="store_true", help="RL goes on with the warm start's AdamW")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="a TrainerConfig field as JSON, e.g. lr=1e-3")
    parser.add_argument("--answers", action="store_true", help="print the wrong held-out answers at each evaluation")
    parser.add_argument("--trace", action="store_true", help="print each iteration's metrics")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fields = with_overrides({"lr": 1e-3, "micro_batch_size": 512, "kl_coef": 0.0}, args.set)
    config = TrainerConfig(**fields)
    with tempfile.TemporaryDirectory() as tmp:
        size = {"hidden_size": args.hidden, "num_layers": args.layers}
        models = {seed: build_tiny_model(Path(tmp) / f"tiny-{seed}", seed=seed, **size) for seed in args.seeds}
        results = [run(seed, args, config, models[seed]) for seed in args.seeds]
    print(
        f"recipe: {fields}, {args.batch} tasks x {args.samples} samples, oversample {args.oversample}, "
        f"failed groups kept {args.keep_failed}"
    )
    for result in results:
        curve = " ".join(f"{value:.2f}" for _, value in result["curve"])
        first = result["updates_to_one"]
        reached = f"1.0 after {first} updates" if first is not None else "1.0 not reached"
        seconds = result["seconds"]
        print(f"seed {result['seed']}: held-out {curve} | final {result['final']:.3f} | {reached} | {seconds:.0f} s")
        for row in result["trace"] if args.trace else []:
            print("   ", row)
    finals = [result["final"] for result in results]
    print(f"final: median {statistics.median(finals):.3f} min {min(finals):.3f} max {max(finals):.3f}")
    firsts = [r["updates_to_one"] if r["updates_to_one"] is not None else float("inf") for r in results]
    print(f"updates to held-out 1.0 (--eval-every {args.eval_every}): median {statistics.median(firsts)}")
    if args.json:
        args.json.write_text(json.dumps({"recipe": fields, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
