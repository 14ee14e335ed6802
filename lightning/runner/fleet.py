"""Many runners at once: threads in this process, each with its own event loop, sharing one store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from lightning.runner import Runner


def start_runner_threads(
    make_runner: Callable[[int], Runner], count: int, stop_event: threading.Event
) -> list[threading.Thread]:
    """Start `count` threads, thread i running `make_runner(i).iter()` until `stop_event` is set."""

    def run(index: int) -> None:
        async def main() -> None:
            runner = make_runner(index)
            try:
                await runner.iter(stop_event=stop_event)
            finally:
                await runner.close()

        asyncio.run(main())

    threads = [threading.Thread(target=run, args=(i,), name=f"runner-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads
