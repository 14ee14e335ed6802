"""`python -m lightning.runner --store URL --agent module:object`: one runner process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from lightning.credentials import split_credentials
from lightning.environment import STORE_TOKEN


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning.runner", description=__doc__)
    parser.add_argument("--store", required=True, help="store URL: http://host:port (store server) or a database URL")
    parser.add_argument("--agent", required=True, help="the agent, as package.module:name")
    parser.add_argument("--token", default=None, help="bearer token of the store server (or LIGHTNING_STORE_TOKEN)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument(
        "--queue",
        default=None,
        help="the store queue to take rollouts from: a training run's name (default: the default queue)",
    )
    parser.add_argument(
        "--max-rollouts", type=int, default=None, help="stop after this many (default: run until killed)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--idle-wait", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns what matters

    from lightning.config import load_agent
    from lightning.errors import ConfigError
    from lightning.runner import Runner
    from lightning.store import AuthError, open_store

    try:
        agent = load_agent(args.agent)
    except ConfigError as exc:
        raise SystemExit(f"--agent {args.agent!r}: {exc}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    async def run() -> int:
        store = open_store(args.store, token=args.token, watchdog_interval=None)
        runner = Runner(
            agent,
            store,
            worker_id=args.worker_id,
            heartbeat_interval=args.heartbeat_interval,
            idle_wait=args.idle_wait,
            queue=args.queue,
        )
        try:
            return await runner.iter(stop_event=stop, max_rollouts=args.max_rollouts)
        finally:
            await runner.close()
            await store.close()

    try:
        ran = asyncio.run(run())
    except AuthError as exc:
        raise SystemExit(f"python -m lightning.runner: {exc}\n{_token_hint(args.token, args.store)}") from None
    print(f"runner ran {ran} rollouts", file=sys.stderr)


def _token_hint(given: str | None, store: str) -> str:
    """What to do about a refused token, by where the token came from (as `open_store` picks it: --token, the store
    URL, the environment)."""
    if given:
        return (
            "The token given with --token is not the store server's. Pass the token `lightning store serve` was "
            "started with, by --token or in $LIGHTNING_STORE_TOKEN."
        )
    if split_credentials(store)[1] is not None:
        return (
            "The token in the --store URL (http://:TOKEN@host:port) is not the store server's. Give the token "
            "`lightning store serve` was started with there, by --token or in $LIGHTNING_STORE_TOKEN."
        )
    if os.environ.get(STORE_TOKEN):
        return (
            "The token in $LIGHTNING_STORE_TOKEN is not the store server's. Set it to the token `lightning store "
            "serve` was started with, or pass that one with --token."
        )
    return (
        "No token was given and this store server needs one. Pass the token `lightning store serve` was started "
        "with, by --token or in $LIGHTNING_STORE_TOKEN."
    )


if __name__ == "__main__":
    main()
