"""The PPO/GRPO update alone, timed: `TorchTrainer.step` under each of its paths beside a plain torch step, on one
random-init Llama and one training batch. Prints a table: seconds per step, tokens/s (real tokens: prompt and
response, padding not counted), MFU (6 x parameters x tokens / time / the GPU's bf16 dense peak; GPU only), peak GPU
memory, and the step's loss and gradient norm (the same batch from the same weights: equal paths give equal numbers).

    .venv/bin/python benchmarks/update_bench.py                       # CPU, small: packing against padding
    .venv/bin/python benchmarks/update_bench.py --size issue --lengths full --micro 16 --variants plain,ours,lean
    .venv/bin/python benchmarks/update_bench.py --size cpu100m --variants lean,lean-lora,lean-kl,lean-lora-kl --memory

Sizes: `small` (hidden 256, 4 layers, vocab 8,000; 16 rows of at most 64 + 192 tokens) for a CPU; `issue` (issue
28's: about 0.47B parameters, hidden 1024, 24 layers, 16 heads, vocab 32,000; 64 rows of 512 + 512 tokens) for a GPU;
`cpu100m` (about 134M parameters, hidden 768, 12 layers, vocab 32,000; 8 rows of at most 64 + 64 tokens): the largest
that a CPU steps through in seconds. `--memory` runs each variant in a process of its own and reports its peak
resident memory (CPU: the model, optimizer state and the update's activations together) beside the memory the model
alone took.
`--lengths mixed` draws each row's prompt from 1/4 to all of the prompt length and its response from 1/8 to all of
the response length (what a batch of agent rollouts looks like); `full` gives every row the whole length.

Variants (`--variants`, comma-separated):
  plain            the step written plainly: padded rows, bf16 autocast on CUDA, log-probs, backward, clip, AdamW
                   (fused on CUDA); a REINFORCE loss, -(log-prob x advantage), which at ratio 1 has GRPO's gradient
  ours             TorchTrainer.step, GRPO without KL, padded micro-batches of --micro rows (the defaults)
  ours-kl          the same with the low-variance KL loss to a frozen reference (a reference forward per step)
  packed           ours with pack_sequences and micro-batches of --micro x (prompt + response) tokens
  lean             packed with logit_chunk_tokens 4096 (no float32 [tokens x vocab] logits)
  lean-kl          lean with the KL loss
  lean-ckpt        lean with gradient checkpointing
  lean-bf16        lean with bf16 weights and float32 master weights
  lean-ckpt-bf16   both
  lean-lora        lean with LoRA adapters (rank 16, alpha 32) on the attention and MLP projections: only they train
  lean-lora-kl     lean-lora with the KL loss (the reference: the base, adapters off; no frozen copy)
  lean-ckpt-lora   lean-lora with gradient checkpointing
  lean-bf16-lora   lean-lora with the base in bf16 (and the adapters, with float32 master copies of them alone)
  lean-ckpt-bf16-lora  lean-ckpt-lora with the base in bf16 (the adapters' float32 master copies alone)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning.algorithm.batch import TrainingBatch  # noqa: E402
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from lightning.algorithm.worker import default_threads  # noqa: E402
from lightning.types import Triplet  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 256, "layers": 4, "heads": 4, "inter": 1024, "vocab": 8000, "rows": 16, "prompt": 64,
              "response": 192, "micro": 4},
    "issue": {"hidden": 1024, "layers": 24, "heads": 16, "inter": 4096, "vocab": 32000, "rows": 64, "prompt": 512,
              "response": 512, "micro": 8},
    "cpu100m": {"hidden": 768, "layers": 12, "heads": 12, "inter": 2048, "vocab": 32000, "rows": 8, "prompt": 64,
                "response": 64, "micro": 4},
}  # fmt: skip

KL = {"use_kl_loss": True, "kl_coef": 0.001, "kl_kind": "low_var_kl"}
LEAN = {"pack_sequences": True, "logit_chunk_tokens": 4096}
LORA = {"lora": {"rank": 16, "alpha": 32}}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ours": {},
    "ours-kl": KL,
    "packed": {"pack_sequences": True},
    "lean": LEAN,
    "lean-kl": {**LEAN, **KL},
    "lean-ckpt": {**LEAN, "gradient_checkpointing": True},
    "lean-bf16": {**LEAN, "bf16_weights": True},
    "lean-ckpt-bf16": {**LEAN, "gradient_checkpointing": True, "bf16_weights": True},
    "lean-lora": {**LEAN, **LORA},
    "lean-lora-kl": {**LEAN, **KL, **LORA},
    "lean-ckpt-lora": {**LEAN, "gradient_checkpointing": True, **LORA},
    "lean-bf16-lora": {**LEAN, "bf16_weights": True, **LORA},
    "lean-ckpt-bf16-lora": {**LEAN, "gradient_checkpointing": True, "bf16_weights": True, **LORA},
}
"""TrainerConfig changes of each variant of ours (None: the plain torch step). Packed ones take micro-batches by
token budget."""

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks (no sparsity), by a name the GPU's name contains."""


def build_model(size: dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["inter"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
        max_position_embeddings=max(2048, size["prompt"] + size["response"]), tie_word_embeddings=False,
        initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).float().eval()


def make_batch(size: dict[str, int], lengths: str, seed: int = 0) -> TrainingBatch:
    """Rows in groups of 8 with 0/1 rewards; random tokens of full or mixed lengths."""
    rng = random.Random(seed)
    triplets = []
    for row in range(size["rows"]):
        prompt_length, response_length = size["prompt"], size["response"]
        if lengths == "mixed":
            prompt_length = rng.randint(max(1, prompt_length // 4), prompt_length)
            response_length = rng.randint(max(1, response_length // 8), response_length)
        triplets.append(
            Triplet(
                prompt=[rng.randrange(size["vocab"]) for _ in range(prompt_length)],
                response=[rng.randrange(size["vocab"]) for _ in range(response_length)],
                reward=float(rng.random() < 0.5),
                metadata={"group_id": f"g{row // 8}"},
            )
        )
    return TrainingBatch.from_triplets(
        triplets, pad_token_id=0, max_prompt_length=size["prompt"], max_response_length=size["response"]
    )


def plain_step(model: torch.nn.Module, batch: TrainingBatch, micro: int, device: torch.device) -> Any:
    """One update written plainly: the reference point for what a step of this model on this batch costs."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=device.type == "cuda" or None)
    on_device = batch.to(device)
    responses, mask = on_device["responses"], on_device["response_mask"].float()
    advantages = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)).to(device) * mask
    count = mask.sum()

    def step() -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, len(batch), micro):
            rows = slice(start, start + micro)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(
                    input_ids=on_device["input_ids"][rows], attention_mask=on_device["attention_mask"][rows],
                    position_ids=on_device["position_ids"][rows], use_cache=False,
                    logits_to_keep=responses.shape[1] + 1,
                ).logits[:, :-1]  # fmt: skip
            log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, responses[rows, :, None]).squeeze(-1)
            loss = -(log_probs * advantages[rows]).sum() / count
            loss.backward()
            total += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return {"loss": total, "grad_norm": float(grad_norm)}

    return step


def ours_step(model: torch.nn.Module, batch: TrainingBatch, changes: dict[str, Any], micro: int, device: Any) -> Any:
    tokens_per_row = batch["input_ids"].shape[1]
    budget = {"micro_batch_tokens": micro * tokens_per_row} if changes.get("pack_sequences") else {}
    config = TrainerConfig(lr=1e-6, advantage="grpo", micro_batch_size=micro, **budget, **changes)
    trainer = TorchTrainer(model, config, device=device)
    return lambda: trainer.step(batch)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step: Any, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """Median seconds of `steps` timed calls after `warmup` untimed ones; peak GPU memory over the timed ones."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for _ in range(steps):
        began = time.perf_counter()
        metrics = step()
        sync(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "times_s": times, "peak_gib": peak, "metrics": metrics}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def rss_gib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def run_variant_alone(name: str, args: argparse.Namespace, size: dict[str, int], batch: TrainingBatch) -> Any:
    """run_variant in a fresh process (spawned: nothing of this one's memory), with its peak resident memory."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_variant_with_memory, (name, args, size, batch))


def _variant_with_memory(name: str, args: argparse.Namespace, size: dict[str, int], batch: TrainingBatch) -> Any:
    import resource

    import peft  # noqa: F401  (imported before the baseline: its own memory is not the update's)

    torch.set_num_threads(args.threads or default_threads(os.cpu_count() or 1, cuda=False))
    before = rss_gib()
    result = run_variant(name, args, size, batch, torch.device("cpu"), keep_model_rss=True)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    result["rss_at_start_gib"] = before
    return result


def run_variant(
    name: str, args: argparse.Namespace, size: dict[str, int], batch: TrainingBatch, device: Any,
    keep_model_rss: bool = False,
) -> Any:  # fmt: skip
    model = build_model(size, device)
    model_rss = rss_gib() if keep_model_rss else None
    params = sum(p.numel() for p in model.parameters())
    changes = VARIANTS[name]
    if changes is None:
        step = plain_step(model, batch, args.plain_micro or size["micro"], device)
    else:
        step = ours_step(model, batch, changes, args.micro or size["micro"], device)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # LoRA froze the base by now
    result = measure(step, device, args.steps, args.warmup)
    del step, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"variant": name, "params": params, "trained_params": trained, "model_rss_gib": model_rss, **result}


def arguments() -> argparse.ArgumentParser:
    """The command line (gpu_check builds its parts' commands on it; tests/test_gpu_check.py checks them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--lengths", choices=["mixed", "full"], default="mixed")
    parser.add_argument("--variants", default="plain,ours,packed,lean")
    parser.add_argument("--micro", type=int, default=None, help="rows per micro-batch of ours (packed: their tokens)")
    parser.add_argument("--plain-micro", type=int, default=None, help="rows per micro-batch of plain")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: half the cores, as the trainer's)"
    )
    parser.add_argument(
        "--memory", action="store_true", help="each variant in a process of its own, with its peak resident memory"
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    load = MachineLoad()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # torch's default of all cores stalls at every barrier on a shared machine (worker.py)
        torch.set_num_threads(args.threads or default_threads(os.cpu_count() or 1, cuda=False))
    size = SIZES[args.size]
    batch = make_batch(size, args.lengths)
    tokens = int(batch["attention_mask"].sum())
    padded = batch["input_ids"].numel()
    peak = peak_flops(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"update on {where}, torch {torch.__version__}: size {args.size}, {len(batch)} rows, {tokens:,} real tokens "
        f"of {padded:,} padded ({args.lengths} lengths), micro {args.micro or size['micro']} rows "
        f"(plain {args.plain_micro or size['micro']}), {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    results = []
    for name in args.variants.split(","):
        try:
            if args.memory and device.type == "cpu":
                result = run_variant_alone(name, args, size, batch)
            else:
                result = run_variant(name, args, size, batch, device)
        except torch.OutOfMemoryError as exc:
            print(f"{name}: out of memory ({str(exc)[:200]})", flush=True)
            results.append({"variant": name, "error": "out of memory"})
            gc.collect()
            torch.cuda.empty_cache()
            continue
        result["tokens_per_s"] = tokens / result["step_s"]
        result["mfu"] = 6 * result["params"] * tokens / result["step_s"] / peak if peak else None
        results.append(result)
        print(f"{name}: {result['step_s']:.3f} s/step ({', '.join(f'{t:.3f}' for t in result['times_s'])})", flush=True)
    base = next((r for r in results if r["variant"] == "plain" and "step_s" in r), None)
    print("\n| variant | trained params | s/step | tokens/s | x plain | MFU | peak GiB | loss | grad norm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "step_s" not in r:
            print(f"| {r['variant']} | {r['error']} | | | | | | | |")
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}" if base else ""
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        memory = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        if r.get("peak_rss_gib") is not None:  # --memory on a CPU: the process's peak, and the model's share of it
            memory = f"{r['peak_rss_gib']:.2f} RSS ({r['peak_rss_gib'] - r['model_rss_gib']:.2f} above the model)"
        loss, grad = r["metrics"].get("loss", float("nan")), r["metrics"].get("grad_norm", float("nan"))
        print(
            f"| {r['variant']} | {r['trained_params'] / 1e6:.1f}M | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{ratio} | {mfu} | {memory} | {loss:.4f} | {grad:.4f} |"
        )
    print(f"\n{load.line()}")
    if args.json:
        info = {"device": where, "torch": torch.__version__, "size": args.size, "lengths": args.lengths,
                "tokens": tokens, "padded_tokens": padded, "peak_flops": peak}  # fmt: skip
        args.json.write_text(json.dumps({**info, "results": results}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
