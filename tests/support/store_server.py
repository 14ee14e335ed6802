"""`lightning store serve` as a process of its own on a free port of 127.0.0.1, behind a bearer token."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prefect_server import REPO_ROOT, free_port, start_logged, stop_process_group, tail

TOKEN_ENV = "LIGHTNING_STORE_TOKEN"
STORE_STARTUP_TIMEOUT = 60.0


@dataclass
class StoreServer:
    url: str
    token: str
    log_path: Path

    def log(self) -> str:
        return tail(self.log_path)


@contextlib.contextmanager
def store_server_on(database: str, token: str, log_path: Path) -> Iterator[StoreServer]:
    """`lightning store serve --db <database>` on a free port of 127.0.0.1, the token in its environment."""
    port = free_port()
    command = [sys.executable, "-m", "lightning.cli", "store", "serve", "--db", database, "--port", str(port)]
    process = start_logged(command, log_path, env={**os.environ, TOKEN_ENV: token}, cwd=REPO_ROOT)
    server = StoreServer(f"http://127.0.0.1:{port}", token, log_path)
    try:
        _wait_store(process, server)
        yield server
    finally:
        stop_process_group(process)


def _wait_store(process: subprocess.Popen, server: StoreServer) -> None:
    deadline = time.monotonic() + STORE_STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the store server exited with {process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            # Any answer (401 without the token) means it is up.
            httpx.get(f"{server.url}/health", timeout=2)
            return
        time.sleep(0.2)
    raise RuntimeError(f"the store server did not answer within {STORE_STARTUP_TIMEOUT:g}s:\n{server.log()}")
