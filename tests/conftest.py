"""Store fixtures: one `store` per backend (SQLite file, SQLite in memory, PostgreSQL, and HTTP:
HttpLightningStore talking to a real server on 127.0.0.1 that holds a SQLite file). And, for the trainer's tests, the
tiny model (`tiny_dir`) and one torch thread (`one_torch_thread`).

PostgreSQL tests run against the server named by LIGHTNING_TEST_PG_URL (default
postgresql://postgres@127.0.0.1:5432/test); each test gets a fresh schema, dropped afterwards.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SESSION_MARKER = "LIGHTNING_TEST_SESSION"
"""Set in the test process's environment, so every process the suite starts carries it (whatever its parent
becomes): at the end, any process still carrying it was left behind, and fails the run."""
LEFTOVER_GRACE_SECONDS = 15.0


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(SESSION_MARKER, uuid.uuid4().hex)
    # pytest-xdist 3.8's groups travel in the node ids ("...::test@group"), which pytest 9.2's structured ids drop:
    # every group would be spread over the workers without a word (pytest-xdist issue 1386).
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2] if part.isdigit())
    if config.getoption("dist", "no") == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(
            f"--dist loadgroup does not group on pytest {pytest.__version__} with pytest-xdist 3.8: install the "
            "dev extra's pytest (below 9.2), or lift that pin once a pytest-xdist release groups on pytest 9.2"
        )


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """No process the suite started may outlive it: wait a little for stragglers, then kill what is left and fail.

    With pytest-xdist (`-n`), the workers inherit the controller's marker, and so do the processes their tests start:
    the controller checks, after the workers have stopped (a wrapper runs after xdist's own sessionfinish, which stops
    them); a worker does not (it would find the other workers, still running)."""
    result = yield
    if not hasattr(session.config, "workerinput"):
        _fail_on_leftover_processes(session)
    return result


def _fail_on_leftover_processes(session: pytest.Session) -> None:
    marker = f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode()
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (leftovers := _processes_carrying(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not leftovers:
        return
    report = "\n".join(f"  pid {pid}: {command}" for pid, command in leftovers.items())
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"FAILED: {len(leftovers)} process(es) started by the tests outlived them (now killed):\n{report}"
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`, `make test-fast`: `-n N --dist loadgroup`), the tests of a module that share a
    module-scoped fixture of that module's own (a Prefect harness, an inference, MLflow or vLLM server, a Ray cluster, a
    deployment trained once) go to one worker together: spread over the workers, each would build the fixture again,
    and again whenever its tests on a worker are interleaved with other modules'. Every other test goes wherever a
    worker is free. A module may name its own group with `pytest.mark.xdist_group(name)` instead."""
    for item in items:
        module = getattr(item, "module", None)
        if module is None or item.get_closest_marker("xdist_group") is not None:
            continue
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(
            definitions[-1].scope == "module" and getattr(definitions[-1].func, "__module__", None) == module.__name__
            for definitions in fixtures.values()
        ):
            item.add_marker(pytest.mark.xdist_group(module.__name__))
    if hasattr(config, "workerinput"):
        # The slow tests first (every worker sorts alike), the many short ones after: they fill in around the last
        # long ones instead of one long test running alone at the end. (One process keeps the files' order.)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _processes_carrying(marker: bytes) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                # A zombie has no command line: it is gone but for its exit status. multiprocessing's resource
                # tracker is this process's own, for its life: it ends when this process does.
                if command and "multiprocessing.resource_tracker" not in command:
                    found[int(entry.name)] = command[:300]
        except OSError:
            continue
    return found


AGL_PYTHON_ENV = "LIGHTNING_AGL_PYTHON"
# agl imports LiteLLM, which otherwise fetches its price list from the internet at import (a minute offline).
AGL_ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def peer_python(variable: str, what: str, target: str, venv: str, marker: str) -> str:
    """The Python another environment's tests run (its path in `variable`); a clear failure where it is missing."""
    python = os.environ.get(variable)
    if not python or not Path(python).is_file():
        pytest.fail(
            f"the {marker} tests run {what}: `make {target}`, then {variable}={venv}/bin/python (`make test` does "
            f"both); or leave them out with -m 'not {marker}'"
        )
    return python


@pytest.fixture(scope="session")
def agl_python() -> str:
    """The Python of agent-lightning 0.3.0's venv (`make agl-peer`), for the tests marked `agl`."""
    return peer_python(AGL_PYTHON_ENV, "agent-lightning 0.3.0's own code", "agl-peer", ".venv-agl", "agl")


DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BACKENDS = ("sqlite_file", "sqlite_memory", "postgres")
SHARED_BACKENDS = ("sqlite_file", "postgres")
"""Backends that several stores (or processes) can open at once."""


def pg_url() -> str:
    return os.environ.get("LIGHTNING_TEST_PG_URL", DEFAULT_PG_URL)


def _psycopg_url(url: str) -> str:
    """The URL as psycopg takes it (no SQLAlchemy driver suffix)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def _with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    option = f"options=-csearch_path%3D{schema}"
    query = f"{parts.query}&{option}" if parts.query else option
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The PostgreSQL URL, after checking that the server answers; fails (never skips) if it does not."""
    import psycopg

    url = pg_url()
    problem = None
    try:
        with psycopg.connect(_psycopg_url(url), connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}".strip()
    if problem is not None:
        pytest.fail(
            f"PostgreSQL at {url!r} did not answer ({problem}).\n"
            "Start one with `bash .ci/postgres.sh` (starts or installs a local server, as CI does),\n"
            "or point LIGHTNING_TEST_PG_URL at one, or leave these tests out with: pytest -m 'not postgres'",
            pytrace=False,
        )
    return url


@pytest.fixture
def pg_schema_url(pg_server: str) -> Iterator[str]:
    """A store URL whose search_path is a fresh schema `t_<uuid>`, dropped with CASCADE afterwards."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex}"
    admin = _psycopg_url(pg_server)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield _with_search_path(pg_server, schema)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _backend_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    if backend == "sqlite_file":
        return f"sqlite:///{tmp_path / 'store.db'}"
    if backend == "sqlite_memory":
        return "sqlite://"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture(
    params=[
        pytest.param("sqlite_file", id="sqlite_file"),
        pytest.param("sqlite_memory", id="sqlite_memory"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store on each backend."""
    return _backend_url(request, request.param, tmp_path)


@pytest.fixture(
    params=[
        pytest.param("sqlite_file", id="sqlite_file"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store that several stores or processes can share."""
    return _backend_url(request, request.param, tmp_path)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a free port of 127.0.0.1 in a background thread; its base URL."""
    import uvicorn

    # Port 0: the system picks a free port. (Handing uvicorn a socket bound here instead made every
    # request wait 40 ms on a delayed ACK.)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-store-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test store server did not start")
        time.sleep(0.002)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(
    params=[
        pytest.param("sqlite_file", id="sqlite_file"),
        pytest.param("sqlite_memory", id="sqlite_memory"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
        pytest.param("http", id="http"),
    ]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """A store without the background watchdog (call `run_watchdog()` explicitly): a SqlLightningStore
    per backend, or (`http`) an HttpLightningStore whose server holds one on a SQLite file."""
    from lightning.store import SqlLightningStore

    if request.param != "http":
        s = SqlLightningStore(_backend_url(request, request.param, tmp_path), watchdog_interval=None)
        try:
            yield s
        finally:
            await s.close()
        return

    from lightning.store.client import HttpLightningStore

    base_url, switch = request.getfixturevalue("store_server")
    # As `lightning store serve` opens it: transactions on the server's loop.
    url = _backend_url(request, "sqlite_file", tmp_path)
    switch.current = SqlLightningStore(url, watchdog_interval=None, threaded=False)
    client = HttpLightningStore(base_url, retries=0)
    try:
        yield client
    finally:
        await client.close()
        served, switch.current = switch.current, None
        await served.close()


class _StoreSwitch:
    """Passes every store call on to `current`, so that one server serves each test's fresh store."""

    current: Any = None

    def __getattr__(self, name: str) -> Any:
        if self.current is None:
            raise AttributeError(f"no test store is open to answer {name}")
        return getattr(self.current, name)


@pytest.fixture(scope="session")
def store_server() -> Iterator[tuple[str, _StoreSwitch]]:
    """One store server on 127.0.0.1 for the whole session (starting one per test costs 0.3 s):
    its base URL, and the switch that the `http` store fixture points at each test's store."""
    from lightning.store.server import create_app

    switch = _StoreSwitch()
    with serving(create_app(switch)) as base_url:  # type: ignore[arg-type]
        yield base_url, switch


@pytest.fixture
async def open_store() -> AsyncIterator[Callable[..., Any]]:
    """open_store(url, **kwargs) -> SqlLightningStore, closed after the test."""
    from lightning.store import SqlLightningStore

    opened: list[Any] = []

    def _open(url: str, **kwargs: Any) -> Any:
        kwargs.setdefault("watchdog_interval", None)
        s = SqlLightningStore(url, **kwargs)
        opened.append(s)
        return s

    try:
        yield _open
    finally:
        for s in reversed(opened):
            await s.close()


# --- the trainer's tests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-init model (seed 0), built once per test module."""
    from lightning.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The tiny model is too small to gain from threads, and two threads on two busy cores spin-wait: one thread
    keeps a module of trainer tests at seconds instead of tens of seconds on a loaded machine. A module takes it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
