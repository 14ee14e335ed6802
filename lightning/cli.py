"""The `lightning` command line: `lightning store serve` runs the store's HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
from collections.abc import Callable, Sequence

from lightning.store.sql import DEFAULT_URL

TOKEN_ENV = "LIGHTNING_STORE_TOKEN"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int] | None = getattr(args, "run", None)
    if run is None:
        # `lightning` or `lightning store` alone: show what there is to run.
        getattr(args, "help_parser", parser).print_help()
        return 2
    return run(args, args.help_parser)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning",
        description="lightning: train LLM agents with reinforcement learning.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    store = commands.add_parser(
        "store",
        help="the store of rollouts, attempts, spans and resources",
        description="The store of rollouts, attempts, spans and resources.",
    )
    store.set_defaults(help_parser=store)
    store_commands = store.add_subparsers(title="commands", metavar="COMMAND")

    serve = store_commands.add_parser(
        "serve",
        help="serve a store over HTTP (the store protocol and OTLP/HTTP traces)",
        description=(
            "Serve a store over HTTP: every store method under /v1/store/, OTLP/HTTP traces at /v1/traces, "
            "GET /health, and the API schema at /docs. Clients use lightning.store.client.HttpLightningStore."
        ),
        epilog=(
            f"The token can also come from ${TOKEN_ENV} (better: a command line is visible to other users "
            "of the machine). Stop the server with Ctrl-C or SIGTERM; the store is closed on the way out."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=4747, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--db",
        default=DEFAULT_URL,
        metavar="URL",
        help="store database: sqlite:///path.db, or postgresql://user:pass@host:port/db (default: %(default)s)",
    )
    serve.add_argument(
        "--token",
        default=None,
        help=f"require 'Authorization: Bearer TOKEN' on every request (default: ${TOKEN_ENV}, else none); "
        "required when --host is not a loopback address",
    )
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (off by default: runners and tracers make thousands a second)",
    )
    serve.set_defaults(run=_serve, help_parser=serve)
    return parser


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from lightning.store.server import create_app
    from lightning.store.sql import SqlLightningStore

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not _is_loopback(args.host):
        parser.error(
            f"refusing to serve on {args.host} without a token: anyone who can reach it could read and change "
            f"the store. Pass --token (or set ${TOKEN_ENV}), or listen on 127.0.0.1."
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = SqlLightningStore(args.db)
    try:
        auth = "bearer token required" if token else "no token"
        print(f"lightning store: {store!r} on http://{args.host}:{args.port} ({auth})", file=sys.stderr, flush=True)
        app = create_app(store, token=token)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    finally:
        asyncio.run(store.close())
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


if __name__ == "__main__":
    raise SystemExit(main())
