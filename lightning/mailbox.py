"""A one-reader queue on one event loop, for the hot paths that hand items to a waiting coroutine (the engine's outputs
to their request, the in-process answer's body to the proxy): an asyncio.Queue's `put_nowait` and `get` without its
bookkeeping (a Queue and the Event inside it, made for every call, were 2.7% of the server's samples in py-spy)."""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items put on `loop`'s thread, read in order by one coroutine of that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[T] = collections.deque()
        self._arrived: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    async def get(self) -> T:
        while not self._items:
            self._arrived = self._loop.create_future()
            await self._arrived
        return self._items.popleft()
