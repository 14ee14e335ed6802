"""A real Prefect server for tests that need one: `prefect server start` on a free port of 127.0.0.1, with a
PREFECT_HOME (and so a SQLite database) of its own, stopped with its process group at the end.

Test modules share one server per session by naming this module as a plugin:

    pytest_plugins = ["prefect_server"]

and asking for the `prefect_server` fixture. (PYTEST_DONT_REWRITE: the test modules import this module's helpers
before pytest loads it as a plugin, too late to rewrite its asserts; it has none.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
STARTUP_TIMEOUT = 120.0


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]
    """The environment for subprocesses that talk to the server (PREFECT_API_URL, the repo on PYTHONPATH)."""
    log_path: Path

    def log(self) -> str:
        return tail(self.log_path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """os.environ with a Prefect of its own: its home, no telemetry, no UI, quick workers."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_CLI_COLORS": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    return env


@contextlib.contextmanager
def running_prefect_server(
    home: Path, timeout: float = STARTUP_TIMEOUT, *, database_url: str | None = None, env: dict[str, str] | None = None
) -> Iterator[PrefectServer]:
    """Start `prefect server start` in its own process group, wait for /api/health, stop the group at the end.
    Its database: `database_url` (postgresql+asyncpg://...) if given, else SQLite in `home`; `env`: more settings."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log_path = home / "server.log"
    server_env = {**prefect_env(home), **(env or {})}
    if database_url:
        server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    command = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    process = start_logged(command, log_path, env=server_env)
    server = PrefectServer(api_url, prefect_env(home, api_url), log_path)
    try:
        _wait_healthy(process, api_url, timeout, server)
        yield server
    finally:
        stop_process_group(process)


def _wait_healthy(process: subprocess.Popen, api_url: str, timeout: float, server: PrefectServer) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited with {process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"prefect server did not answer /api/health within {timeout:g}s:\n{server.log()}")


def stop_process_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process's group, SIGKILL it if the leader has not exited after `grace` seconds."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def start_logged(command: list[str], log_path: Path, **kwargs: Any) -> subprocess.Popen:
    """Start `command` in a session of its own (stop_process_group ends it and its children), output to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)


def tail(path: Path, chars: int = 20_000) -> str:
    """The end of a log file, for failure messages."""
    text = path.read_text(errors="replace") if path.is_file() else "(no log)"
    return f"--- {path} (last {chars} characters) ---\n{text[-chars:]}"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One Prefect server for the session."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect")) as server:
        yield server
