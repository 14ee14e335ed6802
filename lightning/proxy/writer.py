"""Writes the proxy's spans into the store in group commits: a call waits until its span is stored,
and calls that finish together share one request (the store numbers the spans)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lightning.store.base import LightningStore
from lightning.store.errors import NotFoundError
from lightning.types import Span

logger = logging.getLogger(__name__)
_CLOSE: Any = object()


class SpanWriter:
    """`await writer.write(span)` returns once the span is in the store (its `sequence_id` is
    allocated by the store). A store failure is retried `retries` times, then logged and counted in
    `failed`; the agent's call still gets its answer."""

    def __init__(self, store: LightningStore, *, retries: int = 3) -> None:
        self.store = store
        self.retries = retries
        self.written = 0
        self.failed = 0
        self._queue: asyncio.Queue[Any] | None = None
        self._task: asyncio.Task[None] | None = None

    async def write(self, span: Span) -> None:
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue))
        assert self._queue is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((span, done))
        await done

    async def close(self) -> None:
        """Store what is queued, then stop."""
        if self._task is not None and not self._task.done():
            assert self._queue is not None
            self._queue.put_nowait(_CLOSE)
            await self._task
        self._task = None

    async def _run(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            closing = _CLOSE in batch
            await self._commit([item for item in batch if item is not _CLOSE])
            if closing:
                return

    async def _commit(self, batch: list[tuple[Span, asyncio.Future[None]]]) -> None:
        if not batch:
            return
        try:
            await self._store([span for span, _ in batch])
        except NotFoundError:
            # One call named an attempt the store does not know: store the others one by one.
            for span, _ in batch:
                try:
                    await self._store([span])
                except NotFoundError as exc:
                    self.failed += 1
                    logger.error("LLM proxy: span of %s not stored: %s", span.name, exc)
        for _, done in batch:
            if not done.done():
                done.set_result(None)

    async def _store(self, spans: list[Span]) -> None:
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                await self.store.add_many_spans(spans, number=True)  # the store numbers them: one request
                self.written += len(spans)
                return
            except NotFoundError:
                raise
            except Exception as exc:  # the store is another process or database: anything can happen
                if attempt == self.retries:
                    self.failed += len(spans)
                    logger.error("LLM proxy: %d call spans could not be stored: %r", len(spans), exc)
                    return
                logger.warning("LLM proxy: storing spans failed (%r); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay *= 2

    def stats(self) -> dict[str, Any]:
        return {"spans_written": self.written, "spans_failed": self.failed}
