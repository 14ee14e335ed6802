"""`python -m lightning.runner --store URL --agent module:object`: one runner process."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
import threading
from typing import Any

from lightning.agent import LitAgent


def load_agent(entry_point: str) -> LitAgent[Any]:
    """`package.module:name` -> the LitAgent (or @rollout function) it names."""
    module_name, _, attribute = entry_point.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"--agent must look like package.module:name, got {entry_point!r}")
    try:
        agent = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--agent {entry_point!r}: {exc}") from None
    if isinstance(agent, type) and issubclass(agent, LitAgent):
        agent = agent()
    if not isinstance(agent, LitAgent):
        raise SystemExit(f"--agent {entry_point!r} is a {type(agent).__name__}, not a LitAgent or @rollout function")
    return agent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning.runner", description=__doc__)
    parser.add_argument("--store", required=True, help="store URL: http://host:port (store server) or a database URL")
    parser.add_argument("--agent", required=True, help="the agent, as package.module:name")
    parser.add_argument("--token", default=None, help="bearer token of the store server (or LIGHTNING_STORE_TOKEN)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument(
        "--max-rollouts", type=int, default=None, help="stop after this many (default: run until killed)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--idle-wait", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns what matters

    from lightning.runner import Runner
    from lightning.store import open_store

    agent = load_agent(args.agent)
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
        )
        try:
            return await runner.iter(stop_event=stop, max_rollouts=args.max_rollouts)
        finally:
            await runner.close()
            await store.close()

    ran = asyncio.run(run())
    print(f"runner ran {ran} rollouts", file=sys.stderr)


if __name__ == "__main__":
    main()
