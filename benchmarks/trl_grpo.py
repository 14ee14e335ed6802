"""The TRL side of the GRPO comparison: TRL's GRPOTrainer on the tiny model and the copy task, under a wall-time budget.

`run_trl` trains for `seconds` of training wall time and evaluates the held-out tasks (greedy decoding, one left-padded
batch) every `eval_every_s` seconds of it; evaluation time is kept off the training clock, so the curve's elapsed
times and seconds per step measure training alone.

On a GPU (when torch sees one) TRL trains there with bf16 mixed precision, as our trainer does; on a CPU in float32.

One optimizer step = one fresh generation batch of prompts_per_step prompts x generations samples (plain on-policy
GRPO): per_device_train_batch_size counts completions in TRL, and gradient_accumulation_steps = steps_per_generation
= num_iterations = 1, so each batch is generated, scored and used for exactly one update.

Run alone: python benchmarks/trl_grpo.py --seconds 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PrinterCallback,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from examples.copy_task.agent import make_tasks, reward  # noqa: E402


def _messages(task: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": task["letters"]}]


def _completion_text(completion: Any) -> str:
    # Conversational prompts give [{"role": "assistant", "content": text}]; string prompts give the text itself.
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    return (completion or "").strip()


def copy_reward(prompts: list, completions: list, target: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: the copy task's reward on each decoded completion (special tokens skipped, stripped)."""
    return [reward(_completion_text(c), want) for c, want in zip(completions, target, strict=True)]


class HeldoutEvaluator:
    """Greedy-decodes all held-out prompts in one left-padded batch and returns the mean reward."""

    def __init__(self, tokenizer: Any, tasks: list[dict[str, Any]], max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.targets = [task["target"] for task in tasks]
        texts = [tokenizer.apply_chat_template(_messages(t), tokenize=False, add_generation_prompt=True) for t in tasks]
        batch = tokenizer(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
        self.input_ids, self.attention_mask = batch["input_ids"], batch["attention_mask"]
        self.generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=_eos_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            output = model.generate(
                input_ids=self.input_ids.to(device),
                attention_mask=self.attention_mask.to(device),
                generation_config=self.generation_config,
            )
        finally:
            model.train(was_training)
        answers = self.tokenizer.batch_decode(output[:, self.input_ids.shape[1] :], skip_special_tokens=True)
        return sum(reward(a.strip(), t) for a, t in zip(answers, self.targets, strict=True)) / len(self.targets)


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    return [i for i in dict.fromkeys(ids) if i is not None and i != tokenizer.unk_token_id]


class WallClockCallback(TrainerCallback):
    """Stops training after `seconds` of training wall time and evaluates on the held-out tasks along the way.

    The evaluation time is subtracted from the clock, so `elapsed` is time spent training (generation, scoring,
    backward, optimizer) only.
    """

    def __init__(self, evaluate: HeldoutEvaluator, *, seconds: float, eval_every_s: float) -> None:
        self.evaluate = evaluate
        self.seconds = seconds
        self.eval_every_s = eval_every_s
        self.curve: list[tuple[float, int, float]] = []
        self.start = 0.0
        self.eval_time = 0.0
        self.next_eval = eval_every_s
        self.time_to_one: float | None = None
        self.train_seconds = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.eval_time

    def _record(self, model: torch.nn.Module, step: int, elapsed: float) -> None:
        began = time.perf_counter()
        score = self.evaluate(model)
        self.eval_time += time.perf_counter() - began
        self.curve.append((round(elapsed, 3), step, score))
        if self.time_to_one is None and score >= 1.0:
            self.time_to_one = elapsed

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = time.perf_counter()
        self.eval_time = 0.0
        self._record(model, state.global_step, 0.0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        elapsed = self.elapsed()
        self.train_seconds = elapsed
        if elapsed >= self.seconds:
            control.should_training_stop = True
        if control.should_training_stop or elapsed >= self.next_eval:
            self._record(model, state.global_step, elapsed)
            while self.next_eval <= elapsed:
                self.next_eval += self.eval_every_s
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.curve or self.curve[-1][1] != state.global_step:  # ended without a final evaluation (max_steps)
            self.train_seconds = self.elapsed()
            self._record(model, state.global_step, self.train_seconds)


def no_checkpointing() -> dict[str, bool]:
    """TRL defaults gradient checkpointing on; a 2-layer model has nothing to save. Every transformers this project
    takes has `gradient_checkpointing`; later ones (5.24, not 5.17) also `activation_checkpointing`, the new name,
    and 5.17 rejects it as an unknown argument."""
    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    return {name: False for name in ("gradient_checkpointing", "activation_checkpointing") if name in names}


def run_trl(
    model_dir: Path,
    train_tasks: list[dict],
    heldout_tasks: list[dict],
    *,
    seconds: float,
    prompts_per_step: int = 16,
    generations: int = 4,
    lr: float = 3e-4,
    loss_type: str = "dapo",
    max_new_tokens: int = 5,
    seed: int = 0,
    eval_every_s: float = 5.0,
    output_dir: Path,
    threads: int | None = None,
) -> dict:
    """Train the model in `model_dir` with TRL's GRPOTrainer for `seconds` of training wall time, on `threads` torch
    threads (None: torch's default, every core).

    Returns {"curve": [(elapsed_s, step, heldout_reward), ...], "steps", "seconds_per_step", "time_to_1.0",
    "best_heldout"}; elapsed_s and seconds_per_step leave the held-out evaluations out.
    """
    transformers.logging.set_verbosity_warning()
    transformers.logging.disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.WARNING)
    torch.manual_seed(seed)
    if threads is not None:
        torch.set_num_threads(threads)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": _messages(t), "target": t["target"]} for t in train_tasks])
    cuda = torch.cuda.is_available()

    config = GRPOConfig(
        output_dir=str(output_dir),
        seed=seed,
        use_cpu=not cuda,
        bf16=cuda,
        fp16=False,
        **no_checkpointing(),
        # Batch: per_device_train_batch_size counts completions (prompts x generations). With one process, no
        # accumulation, steps_per_generation=1 and num_iterations=1, every optimizer step generates one fresh batch of
        # prompts_per_step prompts x generations samples, scores it and takes one update on it (on-policy GRPO: the
        # importance ratio is exactly 1, so clipping never acts).
        per_device_train_batch_size=prompts_per_step * generations,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=generations,
        max_completion_length=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type=loss_type,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=1_000_000,  # the wall-clock callback stops training
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        log_level="warning",
        dataloader_num_workers=0,
    )
    evaluator = HeldoutEvaluator(tokenizer, heldout_tasks, max_new_tokens)
    clock = WallClockCallback(evaluator, seconds=seconds, eval_every_s=eval_every_s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecation notices from inside TRL and transformers
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=copy_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()

    steps = trainer.state.global_step
    return {
        "curve": clock.curve,
        "steps": steps,
        "seconds_per_step": clock.train_seconds / steps if steps else float("nan"),
        "time_to_1.0": clock.time_to_one,
        "best_heldout": max(score for _, _, score in clock.curve),
    }


RUN_OPTIONS = ("seconds", "prompts_per_step", "generations", "lr", "max_new_tokens", "seed")
"""The command-line options that `run_trl` takes by the same name."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--eval-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-tasks", type=int, default=256)
    parser.add_argument("--heldout-tasks", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    from lightning.models import build_tiny_model

    transformers.logging.disable_progress_bar()
    tasks = make_tasks(args.train_tasks + args.heldout_tasks, seed=args.seed)
    train_tasks, heldout_tasks = tasks[: args.train_tasks], tasks[args.train_tasks :]
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        result = run_trl(
            model_dir,
            train_tasks,
            heldout_tasks,
            eval_every_s=args.eval_every,
            output_dir=Path(tmp) / "out",
            **{option: getattr(args, option) for option in RUN_OPTIONS},
        )
    print(f"{'elapsed_s':>10} {'step':>6} {'heldout':>8}")
    for elapsed, step, score in result["curve"]:
        print(f"{elapsed:10.1f} {step:6d} {score:8.3f}")
    print(
        f"steps={result['steps']} seconds_per_step={result['seconds_per_step']:.3f} "
        f"time_to_1.0={result['time_to_1.0']} best_heldout={result['best_heldout']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
