"""Publishing one update to the embedded inference server, timed: whole weights against a LoRA adapter. Each round
saves a checkpoint the trainer's way (`save_checkpoint`: files, fsync, manifest) and has an `InferenceEngine` serve
it (`reload`: whole weights load from the files; an adapter is merged into the base the engine holds). Prints a
table: checkpoint size, save seconds, reload seconds, both (medians of --rounds), and the ratio whole / adapter.

    .venv/bin/python benchmarks/publish_bench.py                   # cpu100m: about 134M parameters
    .venv/bin/python benchmarks/publish_bench.py --size small --rounds 2

Sizes are update_bench.py's (only the model's shape counts here). The adapter: rank 16, alpha 32, on the attention
and MLP projections, its B matrices random (a trained adapter's, not the all-zero initial one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.update_bench import SIZES, build_model  # noqa: E402
from lightning.algorithm.config import LoraConfig  # noqa: E402
from lightning.algorithm.trainer import add_lora  # noqa: E402
from lightning.checkpoint import save_checkpoint  # noqa: E402
from lightning.inference.engine import InferenceEngine  # noqa: E402
from lightning.models.tiny import build_tokenizer  # noqa: E402


def tree_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def publish(engine: InferenceEngine, root: Path, step: int, model: torch.nn.Module, tokenizer: object) -> dict:
    began = time.perf_counter()
    path = save_checkpoint(root, step, model, tokenizer, trainer_state=None, keep_last=1)
    saved = time.perf_counter()
    asyncio.run(engine.reload(path, step))
    loaded = time.perf_counter()
    return {"save_s": saved - began, "reload_s": loaded - saved, "total_s": loaded - began, "mb": tree_mb(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu100m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="publish-bench-"))
    try:
        model = build_model(SIZES[args.size], torch.device("cpu"))
        tokenizer = build_tokenizer()
        base_dir = work / "base"
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        params = sum(p.numel() for p in model.parameters())
        engine = InferenceEngine(base_dir, device="cpu", dtype="float32")
        where = f"CPU, torch {torch.__version__}, {args.threads} threads"
        print(f"publish on {where}: size {args.size}, {params / 1e6:.0f}M parameters", flush=True)

        rows = {"whole weights": [], "LoRA adapter": []}
        for step in range(1, args.rounds + 1):
            rows["whole weights"].append(publish(engine, work / "full", step, model, tokenizer))
        adapted = add_lora(model, LoraConfig(rank=16, alpha=32), base_dir)
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.01)
        for step in range(1, args.rounds + 1):
            rows["LoRA adapter"].append(publish(engine, work / "lora", step, adapted, tokenizer))
        engine.stop()

        medians = {
            kind: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for kind, runs in rows.items()
        }
        print("\n| published | checkpoint MB | save s | reload s | publish s |")
        print("|---|---|---|---|---|")
        for kind, m in medians.items():
            print(f"| {kind} | {m['mb']:.1f} | {m['save_s']:.2f} | {m['reload_s']:.2f} | {m['total_s']:.2f} |")
        whole, adapter = medians["whole weights"], medians["LoRA adapter"]
        print(
            f"\nwhole / adapter: publish {whole['total_s'] / adapter['total_s']:.1f}x, "
            f"reload {whole['reload_s'] / adapter['reload_s']:.1f}x, size {whole['mb'] / adapter['mb']:.0f}x"
        )
        if args.json:
            args.json.write_text(json.dumps({"size": args.size, "params": params, "rounds": rows}, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
