"""The embedded inference server's decoding throughput: a random-init Llama (update_bench's sizes, saved in float32 as
the trainer saves checkpoints) served by `python -m lightning.inference` in its own process, tokens/s at 1, 16 and 64
concurrent chat requests over HTTP, beside plain `model.generate` on batches of the same sizes in this process (the
same transformers forward without a server or continuous batching: the reference). Both hold the weights in
`--dtype` (auto: bfloat16 on a GPU, float32 on a CPU). Every request decodes exactly --max-tokens tokens.

    .venv/bin/python benchmarks/serving_bench.py [--size small] [--levels 1,16,64] [--max-tokens 64]

The model directory is the tiny tokenizer (`lightning.models.build_tiny_model`) with the sized model's weights: ids
past the tokenizer's decode to nothing, which changes the text, not the work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine_load import MachineLoad  # noqa: E402
from benchmarks.update_bench import SIZES, build_model  # noqa: E402
from lightning.devices import dtype_name, serving_dtype  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.models.files import no_progress_bars  # noqa: E402
from lightning.serving import free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "Copy the last letter: abcd"}]


def model_dir(size: dict[str, int], root: Path, device: torch.device) -> Path:
    """The tiny model's directory (tokenizer, chat template, generation config) with the sized model's weights."""
    from transformers import GenerationConfig

    path = build_tiny_model(root / "model", max_positions=2048)
    model = build_model(size, device)
    tiny = json.loads((path / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, tiny[key])
    model.generation_config = GenerationConfig.from_pretrained(path)
    model.save_pretrained(path)
    return path


async def server_levels(path: Path, args: argparse.Namespace, levels: list[int]) -> tuple[list[dict], dict]:
    """Tokens/s of the server at each level of concurrent requests, and what it says it serves (device, dtype)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "lightning.inference", "--model", str(path), "--port", str(port)]
    command += ["--served-model-name", "bench", "--dtype", args.dtype, "--max-batch-size", str(max(levels))]
    log = open(path.parent / "server.log", "wb")  # noqa: SIM115 (closed below, with the server)
    server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=max(levels) + 4)) as http:
            deadline = time.monotonic() + args.start_timeout
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {(path.parent / 'server.log').read_text()[-2000:]}")
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.5)
            served = (await http.get(f"{url}/admin/version")).json()
            print(f"server: {served['device']}, {served['dtype']}", flush=True)

            async def one(seed: int, max_tokens: int) -> int:
                body = {
                    "model": "bench",
                    "messages": MESSAGES,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": seed,
                }
                answer = await http.post(f"{url}/v1/chat/completions", json=body)
                answer.raise_for_status()
                return answer.json()["usage"]["completion_tokens"]

            await asyncio.gather(*(one(seed, 4) for seed in range(max(levels))))  # warm up, every batch size once
            for level in levels:
                began = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(seed, args.max_tokens) for seed in range(level))))
                wall = time.perf_counter() - began
                rows.append({"concurrency": level, "tokens": tokens, "tokens_per_s": tokens / wall})
                print(f"server, {level} at once: {tokens / wall:,.0f} tokens/s", flush=True)
        return rows, served
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def generate_levels(path: Path, args: argparse.Namespace, levels: list[int], device: torch.device) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = serving_dtype(args.dtype, device)
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)

    def generate(batch: int, tokens: int) -> float:
        ids = prompt_ids.expand(batch, -1).contiguous()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=tokens,
                min_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    generate(max(levels), 4)
    rows = []
    for level in levels:
        wall = generate(level, args.max_tokens)
        rows.append({"batch": level, "tokens": level * args.max_tokens, "tokens_per_s": level * args.max_tokens / wall})
        print(f"model.generate, batch {level}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    return rows


def arguments() -> argparse.ArgumentParser:
    """The command line (gpu_check builds its parts' commands on it; tests/test_gpu_check.py checks them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--levels", default="1,16,64", help="concurrent requests (model.generate: batch sizes)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--start-timeout", type=float, default=180)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main() -> None:
    args = arguments().parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    load = MachineLoad()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # as many as the server's process takes
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    path = model_dir(SIZES[args.size], Path(tempfile.mkdtemp(prefix="serving-bench-")), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(
        f"serving on {where}: size {args.size}, {args.max_tokens} tokens a request, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    server, served = asyncio.run(server_levels(path, args, levels))
    generated = generate_levels(path, args, levels, device)
    dtype = dtype_name(serving_dtype(args.dtype, device))
    print(
        f"\n| concurrent requests | server tokens/s ({served['dtype']}) | model.generate tokens/s ({dtype}) | ratio |"
    )
    print("|---|---|---|---|")
    for ours, theirs in zip(server, generated, strict=True):
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        print(f"| {ours['concurrency']} | {ours['tokens_per_s']:,.0f} | {theirs['tokens_per_s']:,.0f} | {ratio:.2f} |")
    print(f"\n{load.line()}")
    if args.json:
        result = {"device": where, "size": args.size, "served": served, "server": server, "generate": generated}
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
