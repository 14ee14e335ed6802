"""Serve a Hugging Face model directory with the embedded OpenAI-compatible server: `python -m lightning.inference`.

With `--proxy-port`, this process also serves the LLM proxy in front of the model (a run's `inference.with_proxy`):
on that port, storing its spans in the store at $LIGHTNING_STORE_URL, with the token in $LIGHTNING_PROXY_TOKEN; its
calls reach the model without HTTP (`lightning.proxy.local`)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from lightning.devices import dtype_name
from lightning.diagnose import dump_stacks_on_signal
from lightning.environment import INFERENCE_API_KEY, PROXY_TOKEN, STORE_URL
from lightning.inference.server import create_inference_app
from lightning.lifeline import exit_with_parent
from lightning.serving import freeze_startup_objects, is_loopback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning.inference", description=__doc__)
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
    parser.add_argument("--proxy-port", type=int, default=None, help="serve the LLM proxy on this port too")
    parser.add_argument(
        "--proxy-any-agent-key", action="store_true",
        help="the proxy takes any API key on the routes runners hand their agents (loopback only)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    proxy = _proxy_settings(args, parser) if args.proxy_port is not None else None  # refused before the model loads
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
    if proxy is None:
        freeze_startup_objects()  # torch, transformers and the model's modules: never scanned again
        uvicorn.Server(config).run()
        return
    serve_with_proxy(config, args, *proxy)


def _proxy_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str | None, str]:
    """The proxy's token ($LIGHTNING_PROXY_TOKEN; needed beyond loopback) and its store's URL
    ($LIGHTNING_STORE_URL)."""
    token = os.environ.get(PROXY_TOKEN) or None
    if token is None and not is_loopback(args.host):
        parser.error(f"--proxy-port on {args.host}: give the proxy a token in ${PROXY_TOKEN}")
    if args.proxy_any_agent_key and not is_loopback(args.host):
        parser.error(f"--proxy-any-agent-key: only on a loopback address, not {args.host}")
    store_url = os.environ.get(STORE_URL)
    if not store_url:
        parser.error(f"--proxy-port: the proxy stores its spans in the store at ${STORE_URL}; set it")
    return token, store_url


def serve_with_proxy(config: Any, args: argparse.Namespace, token: str | None, store_url: str) -> None:
    """The inference app and the LLM proxy in front of it, on one uvicorn server and event loop listening on both
    ports; the proxy hands its calls to the app in this process."""
    import asyncio

    import uvicorn

    from lightning.proxy import Backend, LLMProxy
    from lightning.store import open_store
    from lightning.types import POLICY_MODEL_NAME

    app = config.app
    backend = f"http://{args.host}:{args.port}/v1"
    store = open_store(store_url, watchdog_interval=None)
    proxy = LLMProxy(
        store, [Backend(url=backend, api_key=args.api_key)], model_name=args.served_model_name or POLICY_MODEL_NAME,
        token=token, agents_need_token=not args.proxy_any_agent_key, tokenizer=args.model,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024), in_process={backend: app},
    )  # fmt: skip
    proxy.url = f"http://{args.host}:{args.port}"
    config.app = _ByPort(app, proxy.app, args.proxy_port)
    sockets = [_listening(args.host, args.port), _listening(args.host, args.proxy_port)]
    _say(f"starting the LLM proxy on http://{args.host}:{args.proxy_port}, spans to {store!r}")
    freeze_startup_objects()
    try:
        uvicorn.Server(config).run(sockets=sockets)
    finally:
        asyncio.run(store.close())


class _ByPort:
    """One ASGI app for two: requests to `proxy_port` go to the proxy, the rest (lifespan too) to the server."""

    def __init__(self, server: Any, proxy: Any, proxy_port: int) -> None:
        self.server, self.proxy, self.proxy_port = server, proxy, proxy_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        server = scope.get("server")
        if server is not None and server[1] == self.proxy_port:
            await self.proxy(scope, receive, send)
        else:
            await self.server(scope, receive, send)


def _listening(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, as uvicorn binds its own (the server listens on it once it starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


KEEP_ALIVE_SECONDS = 300.0
"""How long an idle connection stays open: the LLM proxy's pooled connections outlive the pause between rollout
phases (uvicorn's default, 5 s, closed them: each phase opened new ones, and a call on a connection closed under it
was retried, `ServerDisconnectedError` in the proxy's log). The proxy closes its idle ones sooner
(`lightning.proxy.app.IDLE_CONNECTION_SECONDS`), so it never sends on one this server is closing."""


def _say(line: str) -> None:
    print(f"lightning.inference: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
