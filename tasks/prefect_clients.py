"""Prefect's API clients in this process share their TLS context.

Prefect 3.8 builds a new API client for each flow run and each task run (a client for the task's thread and event
loop, a sync one to hydrate its context, one to read the server's default result storage), and each client loads the
CA bundle into a new `ssl.SSLContext`: ~14 ms of CPU a client here, a fifth of the flow process's CPU in a demo
iteration (docs/benchmarks.md, "Prefect counted"). A context verifying with the same CA file can be shared by any
number of clients (OpenSSL's contexts are meant to be: connections copy what they need), so the clients here get
one such context for each CA file, made the first time one is asked for. A context Prefect changes after making it
(its insecure one, `PREFECT_API_TLS_INSECURE_SKIP_VERIFY`, made without a CA file) is made anew each time, as before.
(Prefect's own way to pass a context is an open pull request, PrefectHQ/prefect#19106.)
"""

from __future__ import annotations

import functools
import ssl
import types
from typing import Any


class _SharedVerifiedContexts(types.ModuleType):
    """The `ssl` module as Prefect's client module sees it: `create_default_context(cafile=...)` made once per CA
    file and purpose, everything else the `ssl` module's own."""

    def __init__(self) -> None:
        super().__init__("ssl")

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    @staticmethod
    def create_default_context(purpose: Any = ssl.Purpose.SERVER_AUTH, **where: Any) -> ssl.SSLContext:
        if where.get("cafile") and not where.get("capath") and not where.get("cadata"):
            return _verified_context(purpose, where["cafile"])
        return ssl.create_default_context(purpose, **where)


@functools.lru_cache(maxsize=8)
def _verified_context(purpose: Any, cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(purpose, cafile=cafile)


def share_tls_contexts() -> bool:
    """Prefect's client module in this process makes its verifying contexts once (see the module's docstring); False
    where that module no longer builds its contexts as this expects (another Prefect), which is then left as it is."""
    import prefect.client.orchestration as clients

    if isinstance(clients.__dict__.get("ssl"), _SharedVerifiedContexts):
        return True
    if clients.__dict__.get("ssl") is not ssl:
        return False
    clients.ssl = _SharedVerifiedContexts()  # type: ignore[attr-defined]
    return True
