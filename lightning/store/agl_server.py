"""agent-lightning's `LightningStoreServer` and `LightningStoreThreaded`, by their names.

`LightningStoreServer(store, host, port)` serves `store` over HTTP from this process, as `lightning store serve`
does from one of its own: our routes (`/v1/store/...`, what `LightningStoreClient` and the runs' processes call),
agl's (`/v1/agl/...`, what agl's own client calls) and OTLP's `/v1/traces` (lightning.store.server.create_app).
`await server.start()` serves it on a thread of this process (`stop()` ends it); `await server.run_forever()` serves
it on the caller's event loop. The object is a store too: calls made on it go to `store` directly.

    store = InMemoryLightningStore()
    server = LightningStoreServer(store, "127.0.0.1", 4747)
    await server.start()                  # agl's clients and ours reach it at server.endpoint
    ...
    await server.stop()

What agl's server has and ours does not: CORS (`cors_allow_origins`; no browser page calls the store here), its
Prometheus `tracker`, and its "mp" launch mode (worker processes sharing the store): those are refused. Beyond
loopback, a server needs `token=` (clients send it as a bearer token, agl's client in the address:
docs/agent-lightning.md), as `lightning store serve` does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Literal

from lightning.env_var import LightningEnvVar, resolve_int_env_var, resolve_str_env_var
from lightning.serving import is_loopback
from lightning.store.base import LightningStore, LightningStoreCapabilities
from lightning.store.contract import Request

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 30.0


class LightningStoreServer(LightningStore):
    """`store` over HTTP at `host:port` (defaults: $AGL_SERVER_HOST, else 127.0.0.1; $AGL_SERVER_PORT, else 4747)."""

    def __init__(
        self,
        store: LightningStore,
        host: str | None = None,
        port: int | None = None,
        cors_allow_origins: Any = None,
        launch_mode: Literal["thread", "asyncio", "mp"] = "thread",
        launcher_args: Any = None,
        n_workers: int = 1,
        tracker: Any = None,
        *,
        token: str | None = None,
    ) -> None:
        refused = {
            "cors_allow_origins": (cors_allow_origins, "no browser page calls the store here; serve it without CORS"),
            "launcher_args": (launcher_args, "give host= and port="),
            "tracker": (tracker, "the server has no Prometheus metrics; statistics() has its counts"),
        }
        for name, (value, why) in refused.items():
            if value is not None:
                raise ValueError(f"LightningStoreServer({name}=...): {why}")
        if launch_mode not in ("thread", "asyncio") or n_workers != 1:
            raise ValueError(
                "LightningStoreServer: one server process serves one store here (launch_mode 'thread' or 'asyncio', "
                "n_workers=1); for a server of its own, run `lightning store serve --db URL` on a SQLite file or "
                "PostgreSQL"
            )
        self.store = store
        self.host = host or resolve_str_env_var(LightningEnvVar.AGL_SERVER_HOST, fallback="127.0.0.1") or "127.0.0.1"
        self.port = port if port is not None else resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, fallback=4747)
        if token is None and not is_loopback(self.host):
            raise ValueError(
                f"LightningStoreServer: refusing to serve on {self.host} without a token: anyone who can reach it "
                "could read and write the store. Give token=..., or listen on 127.0.0.1"
            )
        self.token = token
        self.launch_mode = launch_mode
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"LightningStoreServer({self.store!r}, {self.host!r}, {self.port})"

    @property
    def endpoint(self) -> str:
        """The address clients use: `LightningStoreClient(server.endpoint)`."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return LightningStoreCapabilities(thread_safe=True, async_safe=True, zero_copy=True, otlp_traces=True)

    def otlp_traces_endpoint(self) -> str:
        return f"{self.endpoint}/v1/traces"

    async def handle(self, request: Request) -> Any:
        return await self.store.handle(request)

    def _uvicorn_server(self) -> Any:
        import uvicorn

        from lightning.store.server import create_app

        config = uvicorn.Config(
            create_app(self.store, token=self.token), host=self.host, port=self.port, log_level="warning",
            lifespan="off", access_log=False,
        )  # fmt: skip
        return uvicorn.Server(config)

    async def start(self) -> None:
        """Serve in the background: on a thread of this process (launch_mode 'thread') or as a task of this event
        loop ('asyncio'); returns once the server listens."""
        if self._server is not None:
            raise RuntimeError(f"{self!r} is serving already")
        self._server = server = self._uvicorn_server()
        if self.launch_mode == "thread":
            self._thread = threading.Thread(target=server.run, name="lightning-store-server", daemon=True)
            self._thread.start()
            alive = self._thread.is_alive
        else:
            task = self._task = asyncio.get_running_loop().create_task(server.serve())

            def alive() -> bool:
                return not task.done()

        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT
        while not server.started:
            if not alive() or asyncio.get_running_loop().time() > deadline:
                self._server = None
                raise RuntimeError(f"{self!r} did not start (is port {self.port} taken?)")
            await asyncio.sleep(0.02)
        logger.info("serving %r at %s", self.store, self.endpoint)

    async def run_forever(self) -> None:
        """Serve on this event loop until cancelled (or `stop`)."""
        self._server = self._uvicorn_server()
        try:
            await self._server.serve()
        finally:
            self._server = None

    async def stop(self) -> None:
        """Stop serving (the store stays open: close it yourself)."""
        server, thread, task = self._server, self._thread, self._task
        self._server = self._thread = self._task = None
        if server is None:
            return
        server.should_exit = True
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)
        if task is not None:
            await asyncio.wait_for(task, 10.0)

    async def close(self) -> None:
        """Stop serving and close the store."""
        await self.stop()
        await self.store.close()


def LightningStoreThreaded(store: LightningStore) -> LightningStore:  # noqa: N802 (agl's class name)
    """agent-lightning's thread-safe wrapper of a store: every store here is thread-safe already, so this is the store
    itself."""
    return store


__all__ = ["LightningStoreServer", "LightningStoreThreaded"]
