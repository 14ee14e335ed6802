"""Serve a Hugging Face model directory with the embedded OpenAI-compatible server: `python -m lightning.inference`.
(`python -m lightning.stack` serves the LLM proxy in front of it in the same process.)"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from lightning.devices import dtype_name
from lightning.diagnose import dump_stacks_on_signal
from lightning.environment import INFERENCE_API_KEY
from lightning.inference.server import create_inference_app
from lightning.lifeline import exit_with_parent
from lightning.serving import freeze_startup_objects, is_loopback


def main(argv: list[str] | None = None) -> None:
    parser = arguments("python -m lightning.inference", __doc__)
    serve(parser.parse_args(argv), parser)


def arguments(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The server's command line (`python -m lightning.stack` adds the proxy's)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: dir name)")
    parser.add_argument("--api-key", default=os.environ.get(INFERENCE_API_KEY))
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="the weights' dtype (auto: bfloat16 on a GPU that has it, float32 on a CPU)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores but one)")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="each sequence decodes alone: the same tokens whatever the load"
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=32, help="answer 413 to a request body larger than this (default: 32)"
    )
    parser.add_argument("--access-log", action="store_true", help="a log line per request (default: none)")
    parser.add_argument(
        "--keep-alive", type=float, default=KEEP_ALIVE_SECONDS,
        help=f"seconds an idle connection stays open (default: {KEEP_ALIVE_SECONDS:g})",
    )  # fmt: skip
    return parser


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser, run: Callable[[Any], None] | None = None) -> None:
    """Load the model and serve it; `run(config)` serves the uvicorn config instead of a plain uvicorn server."""
    exit_with_parent()  # started by a run: it dies with the run
    dump_stacks_on_signal(None, "inference-server")  # into the run's stacks directory, when a run started it
    if not is_loopback(args.host) and not args.api_key:
        # Anyone who can reach the port could otherwise generate on, and reload, this model.
        parser.error(
            f"--host {args.host} is reachable from other machines; give --api-key (or LIGHTNING_INFERENCE_API_KEY)"
        )
    # What it is doing while it starts (a minute on a loaded machine): the lines a run quotes if it is too slow.
    _say(f"pid {os.getpid()}: importing torch and transformers")
    import torch
    import uvicorn

    _say(f"loading the model {args.model}")
    # One core is left to the HTTP event loop, which tokenizes prompts and streams responses.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    app = create_inference_app(
        args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        api_key=args.api_key,
        batch_invariant=args.batch_invariant,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )
    engine = app.state.engine
    _say(f"serving {engine.model_path} on {engine.device} in {dtype_name(engine.dtype)}")
    _say(f"starting the HTTP server on http://{args.host}:{args.port}")
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
        timeout_keep_alive=int(args.keep_alive),
    )  # fmt: skip
    if run is not None:
        run(config)
        return
    freeze_startup_objects()  # torch, transformers and the model's modules: never scanned again
    uvicorn.Server(config).run()


KEEP_ALIVE_SECONDS = 300.0
"""How long an idle connection stays open: the LLM proxy's pooled connections outlive the pause between rollout
phases (uvicorn's default, 5 s, closed them: each phase opened new ones, and a call on a connection closed under it
was retried, `ServerDisconnectedError` in the proxy's log). The proxy closes its idle ones sooner
(`lightning.proxy.app.IDLE_CONNECTION_SECONDS`), so it never sends on one this server is closing."""


def _say(line: str) -> None:
    print(f"lightning.inference: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
