"""agent-lightning 0.3.0's own store tests, through its `LightningStoreClient`, against our store server and against
agl's own: the 122 tests of its tests/store/test_core.py that take the `store_fixture` (the ones it runs on each store
implementation), side by side. Each test gets a fresh server in a process of its own, forked from one that imported
it once (a server starts in a fraction of a second): ours is `lightning store serve` on a SQLite file of its own,
agl's its `LightningStoreServer` as `agl store` runs it, over its tests' store (`InMemoryLightningStore` with
`scan_debounce_seconds=0`). `--servers agl-thread` runs agl's server in the tests' process instead, as agl's own
client-server tests do: there the 3 tests that patch the store's clock or read its log reach it and pass. The tests
run in agl's venv (Python 3.12, agentlightning 0.3.0), with pytest and pytest-asyncio put beside it in
.lightning/agl-pytest/ when it lacks them.

    git --git-dir=MIRROR archive v0.3.0 tests | tar -x -C /tmp/agl-0.3.0     # agl's tests of the 0.3.0 tag
    .venv/bin/python benchmarks/agl_store_conformance.py --agl-repo /tmp/agl-0.3.0 [--runs 2] [-k wait]

It prints a row per test (its outcome on each server; with --runs N, `k/N passed` where runs disagree), then the
first line of our failure for each test that passes on agl's server and fails on ours, then the counts (on 2 busy
cores: about 3 minutes a run per server). docs/agent-lightning.md says why each remaining difference is on purpose.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("agl", "agl-thread", "ours")
LABELS = {"agl": "agl's server", "agl-thread": "agl's, thread", "ours": "ours"}
PYTEST_DIR = REPO_ROOT / ".lightning" / "agl-pytest"

# Appended to agl's tests/store/conftest.py in the copy the tests run from: a later definition of a fixture in the
# same module replaces agl's parametrised one, so every `store_fixture` test gets a client of a fresh server.
FIXTURE = '''

# --- appended by lightning-flows' benchmarks/agl_store_conformance.py ---
import json as _json
import os as _os
import urllib.request as _request

from agentlightning.store.client_server import LightningStoreClient as _Client
from agentlightning.store.client_server import LightningStoreServer as _Server


@pytest_asyncio.fixture
async def store_fixture():
    if _os.environ["AGL_CONFORMANCE_SERVER"] == "agl-thread":
        from portpicker import pick_unused_port

        server = _Server(InMemoryLightningStore(scan_debounce_seconds=0), "127.0.0.1", pick_unused_port())
        await server.start()
        client = _Client(server.endpoint)
        try:
            yield client
        finally:
            await client.close()
            await server.stop()
        return
    factory = _os.environ["AGL_CONFORMANCE_FACTORY"]
    with _request.urlopen(factory + "/start", data=b"", timeout=60) as answer:
        started = _json.load(answer)
    client = _Client(started["url"])
    try:
        yield client
    finally:
        await client.close()
        _request.urlopen(factory + "/stop/" + str(started["pid"]), data=b"", timeout=60).close()


def pytest_collection_modifyitems(config, items):
    """Only the tests that take the store fixture: the others test agl's in-memory store's own internals."""
    kept = [item for item in items if "store_fixture" in getattr(item, "fixturenames", ())]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
'''

PYTEST_INI = """[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    store: agl's store tests
    mongo: agl's MongoDB tests
filterwarnings = ignore
"""


# --- our servers, forked from one process that imported them once ---------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            raise RuntimeError(f"the store server {pid} exited while starting")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/v1/agl/health", timeout=2).close()
            return
        time.sleep(0.05)
    raise RuntimeError(f"the store server at {url} did not answer within {timeout:g}s")


def serve_factory(kind: str, workdir: Path, watchdog_interval: float, scan_debounce: float, port_file: Path) -> None:
    """A control server on loopback: POST /start forks a fresh store server (`kind`: ours, `lightning store serve`
    on a SQLite file of its own; or agl's) and answers its URL and pid; POST /stop/PID stops it. Forking a process
    that has no thread is safe, and each server starts without paying for the imports."""
    serve = our_server(watchdog_interval) if kind == "ours" else agl_server(scan_debounce)
    made = 0

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            nonlocal made
            if self.path == "/start":
                made += 1
                port = free_port()
                pid = os.fork()
                if pid == 0:
                    self.server.socket.close()
                    code = 1
                    try:
                        code = serve(port, workdir / f"store-{made}.db")
                    finally:
                        os._exit(code or 0)
                url = f"http://127.0.0.1:{port}"
                wait_until_up(url, pid)
                answer: dict[str, Any] = {"url": url, "pid": pid}
            else:
                answer = {"stopped": stop(int(self.path.rsplit("/", 1)[-1]))}
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    control = HTTPServer(("127.0.0.1", 0), Handler)
    port_file.write_text(str(control.server_address[1]))
    control.serve_forever()


def stop(pid: int, grace: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds: a server waits for its open requests on the way out, and a test
    that cancelled a wait without a timeout leaves one open for good."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    return pid


def our_server(watchdog_interval: float) -> Callable[[int, Path], int]:
    """`lightning store serve --db sqlite:///DB --port PORT`, its command line as a user runs it."""
    import uvicorn  # noqa: F401  # imported here, once, for every forked server

    from lightning import cli
    from lightning.store import server, sql  # noqa: F401

    def serve(port: int, db: Path) -> int:
        argv = ["store", "serve", "--db", f"sqlite:///{db}", "--port", str(port), "--log-level", "warning"]
        return cli.main([*argv, "--watchdog-interval", str(watchdog_interval)])

    return serve


def agl_server(scan_debounce: float) -> Callable[[int, Path], int]:
    """agl's `LightningStoreServer` as `agl store` runs it (a thread-safe in-memory store, launch mode asyncio). Its
    store scans for timed-out and unresponsive attempts on a call at most every `scan_debounce` seconds: 0 in agl's
    tests' store, 10 (InMemoryLightningStore's default) in `agl store`'s."""
    import asyncio

    import uvicorn  # noqa: F401
    from agentlightning.store.client_server import LightningStoreServer
    from agentlightning.store.memory import InMemoryLightningStore

    def serve(port: int, db: Path) -> int:
        store = InMemoryLightningStore(thread_safe=True, scan_debounce_seconds=scan_debounce)
        server = LightningStoreServer(store, host="127.0.0.1", port=port, launch_mode="asyncio")
        asyncio.run(server.run_forever())
        return 0

    return serve


@contextlib.contextmanager
def factory_running(
    kind: str, python: str, env: dict[str, str], workdir: Path, args: argparse.Namespace
) -> Iterator[str]:
    """The server factory of `kind` in `python`; its control URL."""
    home = workdir / f"factory-{kind}"
    home.mkdir()
    command = [
        python,
        __file__,
        "--factory",
        kind,
        "--home",
        str(home),
        "--watchdog-interval",
        str(args.watchdog_interval),
    ]
    command += ["--agl-scan-debounce", str(args.agl_scan_debounce)]
    log = (home / "servers.log").open("w")  # each server's startup line, and what went wrong
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    port_file = home / "factory.port"
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} server factory did not start: {(home / 'servers.log').read_text()}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


# --- agl's tests --------------------------------------------------------------------------------------------------


def agl_environment(agl_python: str) -> dict[str, str]:
    """agl's venv, with pytest and pytest-asyncio beside it when it lacks them (installed once, not into it)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("PYTHONPATH", None)
    check = [agl_python, "-c", "import agentlightning, pytest, pytest_asyncio, portpicker"]
    if subprocess.run(check, env=env, capture_output=True).returncode == 0:
        return env
    env["PYTHONPATH"] = str(PYTEST_DIR)
    if subprocess.run(check, env=env, capture_output=True).returncode != 0:
        print(f"installing pytest and pytest-asyncio for agl's Python into {PYTEST_DIR}", file=sys.stderr)
        # Without their dependencies agl's venv has (packaging, pygments): a newer copy here would shadow its own.
        install = [agl_python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(PYTEST_DIR)]
        subprocess.run([*install, "pytest>=8,<10", "pytest-asyncio>=0.24,<2", "pluggy", "iniconfig"], check=True)
    return env


def copy_tests(agl_repo: Path, workdir: Path) -> Path:
    """agl's tests/store, its conftest with our fixture appended, and a pytest.ini of its markers."""
    source = agl_repo / "tests" / "store"
    if not (source / "test_core.py").exists():
        raise SystemExit(f"{source}/test_core.py not found: give --agl-repo a checkout of agent-lightning 0.3.0")
    tests = workdir / "agl-tests"
    shutil.copytree(source, tests / "tests" / "store", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(agl_repo / "tests" / "__init__.py", tests / "tests" / "__init__.py")
    with (tests / "tests" / "store" / "conftest.py").open("a") as conftest:
        conftest.write(FIXTURE)
    (tests / "pytest.ini").write_text(PYTEST_INI)
    return tests


def run_tests(tests: Path, agl_python: str, env: dict[str, str], server: str, keyword: str | None) -> dict[str, Any]:
    """One pass of the tests against `server`: each test's outcome and, if it did not pass, its message's first
    line."""
    report = tests / f"report-{server}.xml"
    command = [agl_python, "-m", "pytest", "tests/store/test_core.py", "-q", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(report)] + (["-k", keyword] if keyword else [])
    subprocess.run(command, cwd=tests, env=env, capture_output=True)
    outcomes: dict[str, Any] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[0][:300]
                break
        outcomes[case.get("name", "")] = (outcome, message)
    return outcomes


def combine(runs: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Each test's outcome over the runs: the outcome if they agree, else `k/N passed`; the last failure's line."""
    combined = {}
    for name in runs[0]:
        seen = [run.get(name, ("missing", "")) for run in runs]
        outcomes = {outcome for outcome, _ in seen}
        passed = sum(outcome == "passed" for outcome, _ in seen)
        message = next((m for outcome, m in reversed(seen) if outcome != "passed"), "")
        combined[name] = (outcomes.pop() if len(outcomes) == 1 else f"{passed}/{len(runs)} passed", message)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agl-repo", type=Path, help="a checkout of agent-lightning 0.3.0 (its tests/ at least)")
    parser.add_argument(
        "--agl-python", default=os.environ.get("LIGHTNING_AGL_PYTHON", str(REPO_ROOT / ".venv-agl" / "bin" / "python")),
        help="Python of a venv with agentlightning 0.3.0 (default: $LIGHTNING_AGL_PYTHON, else .venv-agl's)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=1, help="passes per server (timing-bound tests: 2 or more)")
    parser.add_argument(
        "--servers", default="agl,ours",
        help="which servers, of agl (a process of its own), agl-thread (in the tests' process, as agl's own "
        "client-server tests run it: tests that patch the store's clock or read its log reach it), ours "
        "(default: agl,ours)",
    )  # fmt: skip
    parser.add_argument(
        "--watchdog-interval", type=float, default=1.0,
        help="our server's --watchdog-interval (default: its own default, 1 s)",
    )  # fmt: skip
    parser.add_argument(
        "--agl-scan-debounce", type=float, default=0.0,
        help="agl's server's scan_debounce_seconds (default: 0, its tests' store; `agl store` runs with 10)",
    )  # fmt: skip
    parser.add_argument("-k", dest="keyword", help="pytest's -k: only the tests it selects")
    parser.add_argument("--factory", choices=("ours", "agl"), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.factory is not None:
        serve_factory(
            args.factory, args.home, args.watchdog_interval, args.agl_scan_debounce, args.home / "factory.port"
        )
        return
    if args.agl_repo is None:
        parser.error("--agl-repo is required")
    servers = [server for server in SERVERS if server in args.servers.split(",")]
    env = agl_environment(args.agl_python)
    results: dict[str, dict[str, tuple[str, str]]] = {}
    with tempfile.TemporaryDirectory(prefix="agl-conformance-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        tests = copy_tests(args.agl_repo.resolve(), workdir)
        factories = {"ours": (sys.executable, os.environ), "agl": (args.agl_python, env)}
        for server in servers:
            server_env = {**env, "AGL_CONFORMANCE_SERVER": server}
            if server in factories:
                python, factory_env = factories[server]
                factory = factory_running(server, python, dict(factory_env), workdir, args)
                server_env["AGL_CONFORMANCE_FACTORY"] = stack.enter_context(factory)
            runs = []
            for run in range(1, args.runs + 1):
                started = time.monotonic()
                runs.append(run_tests(tests, args.agl_python, server_env, server, args.keyword))
                passed = sum(outcome == "passed" for outcome, _ in runs[-1].values())
                print(
                    f"[{LABELS[server]}] run {run}/{args.runs}: {passed} of {len(runs[-1])} passed "
                    f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True,
                )  # fmt: skip
            results[server] = combine(runs)
    print_table(results, servers, args)


def print_table(results: dict[str, dict[str, tuple[str, str]]], servers: list[str], args: argparse.Namespace) -> None:
    names = list(dict.fromkeys(name for server in servers for name in results[server]))
    width = max(len(name) for name in names)
    print(f"agent-lightning 0.3.0's tests/store/test_core.py, store_fixture tests, {args.runs} run(s) per server")
    print(f"\n{'test':<{width}}  " + "  ".join(f"{LABELS[s]:<14}" for s in servers))
    for name in names:
        print(f"{name:<{width}}  " + "  ".join(f"{results[s].get(name, ('-', ''))[0]:<14}" for s in servers))
    if "agl" in servers and "ours" in servers:
        differ = [
            name for name in names
            if results["agl"].get(name, ("", ""))[0] == "passed" and results["ours"].get(name, ("", ""))[0] != "passed"
        ]  # fmt: skip
        print(f"\npassing on agl's server, not on ours: {len(differ)}")
        for name in differ:
            print(f"  {name}: {results['ours'][name][1]}")
        both = [name for name in names if "passed" not in (results["agl"][name][0], results["ours"][name][0])]
        print(f"\nfailing on both (agl's failure): {len(both)}")
        for name in both:
            print(f"  {name}: {results['agl'][name][1]}")
    print()
    for server in servers:
        passed = sum(outcome == "passed" for outcome, _ in results[server].values())
        print(f"{LABELS[server]}: {passed} of {len(results[server])} passed in every run")


if __name__ == "__main__":
    main()
