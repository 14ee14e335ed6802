"""agent-lightning 0.3's answers for rollout ids a store does not know, where a caller reaches us through agl's names
or routes: `query_spans` answers an empty page and `wait_for_rollouts` leaves the ids out (agl's in-memory store;
its tests test_query_empty_spans, test_wait_for_nonexistent_rollout, test_wait_mixed_existing_and_nonexistent_
rollouts). Our own API raises `NotFoundError` for both, which says more (docs/agent-lightning.md's table).

Who answers so: the `/v1/agl/...` routes (lightning.store.agl_routes), and the stores by agl's names
(`InMemoryLightningStore`, `LightningStoreClient`, the store `Trainer` hands an agl `Algorithm`), through
`AglUnknownIds`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from lightning.store import contract
from lightning.store.base import LightningStore
from lightning.store.errors import NotFoundError
from lightning.types import PaginatedResult, Span


async def answer_as_agl(
    store: LightningStore, request: contract.Request, handle: Callable[[contract.Request], Awaitable[Any]]
) -> Any:
    """`handle(request)`, with agl's answers for unknown rollout ids: a wait leaves them out (none known: none,
    after the timeout, as waiting for ids that never finish), a span query answers an empty page."""
    if isinstance(request, contract.WaitForRollouts):
        known = {rollout.rollout_id for rollout in await store.query_rollouts(rollout_id_in=request.rollout_ids)}
        request = request.model_copy(update={"rollout_ids": [rid for rid in request.rollout_ids if rid in known]})
        if not request.rollout_ids:
            await asyncio.sleep(min(request.timeout or 0.0, contract.MAX_WAIT_SECONDS))
            return []
    try:
        return await handle(request)
    except NotFoundError:
        if not isinstance(request, contract.QuerySpans):
            raise
        return PaginatedResult[Span](items=[], limit=request.limit, offset=request.offset, total=0)


class AglUnknownIds(LightningStore):
    """A store answering unknown rollout ids as agl's does (`answer_as_agl`); put it first among the bases:
    `class InMemoryLightningStore(AglUnknownIds, SqlLightningStore)`."""

    async def handle(self, request: contract.Request) -> Any:
        return await answer_as_agl(self, request, super().handle)
