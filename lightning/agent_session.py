"""The kept-alive HTTP session agents call their LLM with (`LLM.http_session()`): one aiohttp session per event loop,
shared by every agent on it. A session per rollout opens a TCP connection per call, which cost a runner process about
a fifth of its CPU on the demo (issue 39)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator

import aiohttp

KEEPALIVE_SECONDS = 4.0
"""How long an idle connection is kept for the next call: under uvicorn's 5 s (the LLM proxy's), so that the client,
not the server, closes it, and no call goes out on a connection the server is closing."""

_sessions: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, AsyncGenerator[None, None]]] = {}
_lock = threading.Lock()


async def loop_session() -> aiohttp.ClientSession:
    """This event loop's session: made on the first call, closed as the loop shuts down (a runner's fleet, asyncio.run
    and pytest's loops all close a loop's async generators first, and `_holder` is one). No limit on connections: one
    a call in flight, as a session per rollout had. No timeout of its own: give one per request."""
    loop = asyncio.get_running_loop()
    with _lock:
        found = _sessions.get(loop)
        if found is not None and not found[0].closed:
            return found[0]
        ended = [_sessions.pop(other)[1] for other in list(_sessions) if other.is_closed()]
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS))
        holder = _holder(loop, session)
        _sessions[loop] = (session, holder)
    await holder.asend(None)
    for old in ended:
        await old.aclose()  # its loop has ended: aiohttp just lets go of the sockets
    return session


async def _holder(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Closes `session` when closed itself: by its loop's shutdown, which closes the async generators started on it."""
    try:
        yield
    finally:
        with _lock:
            if _sessions.get(loop, (None,))[0] is session:
                del _sessions[loop]
        await session.close()
