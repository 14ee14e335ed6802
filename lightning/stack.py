"""The embedded serving parts of a run on one machine: the inference server for a model directory and the LLM
proxy in front of it, each on a thread of this process or in a process of its own, or both in one process
(`python -m lightning.stack`, `main` below).

Each listens on 127.0.0.1 behind a random token of its own (the proxy's reaches runners through the environment),
so another user of the machine can neither generate on the model, reload it, nor write spans. A process of its
own dies with this one (`lightning.lifeline`), gets its secrets through its environment (never its command line,
which `ps` shows), and writes its output to `log_dir`. `restart_dead()` starts again, on the same port, a process
that has exited or stopped answering: the supervision of a run (`lightning.run`) calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lightning import stopping
from lightning.environment import BACKEND_API_KEY, INFERENCE_API_KEY, PROXY_TOKEN, STACKS_DIR, STORE_URL
from lightning.lifeline import child_env
from lightning.serving import (
    DEFAULT_MAX_BODY_BYTES,
    ThreadedServer,
    free_port,
    freeze_startup_objects,
    is_loopback,
    tls_context,
)
from lightning.store.base import LightningStore
from lightning.types import POLICY_MODEL_NAME

HEALTH_TIMEOUT = 5.0
STRIKES = 3
"""Health checks in a row a live process may fail before it is taken for hung, killed and restarted."""
REPORT_EVERY = 15.0
"""Seconds between the lines that say a process is still starting (a loaded machine takes minutes)."""
LOG_LINES = 20
"""Lines of a process's log that its errors quote."""
SERVER_WITH_PROXY = "inference server and LLM proxy"
"""The name of the process that serves both (`LocalStack(proxy="server")`): a restart starts its proxy anew too."""


@dataclass
class ServerProcess:
    """One server in a process of its own: how to start it, where it answers, what it has done."""

    name: str
    """What errors and logs call it ("inference server", "LLM proxy")."""
    command: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    start_timeout: float
    """Seconds it may take to answer, on a start and on each restart (a run's `timeouts.startup`)."""
    report: Callable[[str], None] | None = field(default=None, repr=False)
    """Where the lines go that say it is still starting, every REPORT_EVERY seconds (a flow's logger)."""
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    strikes: int = field(default=0, repr=False)
    client: httpx.Client | None = field(default=None, repr=False)
    """The health checks' one kept-alive connection while the process lives: a client per check would build an SSL
    context each second (26% of a runner process's samples in a profile), for a plain http:// URL."""
    _spawned: float = field(default=0.0, repr=False)

    def start(self, deadline: float | None = None) -> None:
        """Start the process and wait until it answers: at most `start_timeout` seconds, or until the monotonic
        `deadline` if that comes first (one deadline shared by the parts of a run)."""
        self.spawn()
        self.wait_until_answering(deadline)

    def spawn(self) -> None:
        """Start the process; `wait_until_answering` then waits for it (the parts of a run start side by side)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Output goes to a file, not a pipe: nobody drains a pipe after start-up, and a full one blocks the server.
        with open(self.log_path, "ab") as log:
            log.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name} on {self.url}\n".encode())
            log.flush()
            # A session of its own: Ctrl-C in a terminal signals the whole foreground process group, and the run
            # stops its servers itself, in order (the supervisor would take one that stopped on it for a crash).
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env(**self.env),
                start_new_session=True,
            )  # fmt: skip
        self._spawned = time.monotonic()

    def wait_until_answering(self, deadline: float | None = None) -> None:
        """Wait until the spawned process answers: at most `start_timeout` seconds from its spawn, or until the
        monotonic `deadline` if that comes first."""
        assert self.process is not None, "spawn() first"
        started = self._spawned
        deadline = min(started + self.start_timeout, deadline or float("inf"))
        next_report = started + REPORT_EVERY
        while time.monotonic() < deadline:
            if stopping.stop_requested():  # a run that is stopping waits for no server
                self.stop()
                raise stopping.RunStopped(f"the {self.name} was starting when the run was asked to stop")
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the {self.name} ({self.url}) exited with code {self.process.returncode} while starting; the "
                    f"end of its log {self.log_path}:\n{self.log_tail()}"
                )
            if self.answers(timeout=1.0):
                self.strikes = 0
                return
            if self.report is not None and time.monotonic() >= next_report:
                next_report += REPORT_EVERY
                last = self.log_tail(1).strip() or "(nothing yet)"
                self.report(
                    f"waiting for the {self.name} (pid {self.process.pid}) to answer on {self.url}: "
                    f"{time.monotonic() - started:.0f} s so far (timeouts.startup: {self.start_timeout:g} s); "
                    f"its log's last line: {last}"
                )
            time.sleep(0.1)
        pid, waited, tail = self.process.pid, time.monotonic() - started, self.log_tail().strip()
        self.stop()
        raise TimeoutError(
            f"the {self.name} (pid {pid}) did not answer on {self.url} after {waited:.0f} s, the rest of "
            f"timeouts.startup ({self.start_timeout:g} s; raise it on a slow or loaded machine); the end of its log "
            f"{self.log_path}:\n{tail}"
        )

    def answers(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        if self.client is None:
            self.client = httpx.Client(base_url=self.url)
        try:
            return self.client.get("/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def healthy(self) -> bool:
        """Running and answering; a process that fails STRIKES health checks in a row counts as hung."""
        if self.process is None or self.process.poll() is not None:
            return False
        self.strikes = 0 if self.answers() else self.strikes + 1
        return self.strikes < STRIKES

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        process, self.process = self.process, None
        client, self.client = self.client, None
        if client is not None:
            client.close()
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, lines: int = LOG_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalStack:
    """The embedded serving pieces of a training run on one machine: the inference server for `model_dir` and the
    LLM proxy in front of it, storing spans in `store`.

    Each runs on a thread of this process (tests reach the engine as `inference_app.state.engine` and the proxy as
    `proxy`), or in a process of its own (`server="process"`, `proxy="process"` with the store's `store_url`),
    which gives it a core of its own instead of sharing this process's interpreter lock with the runners and the
    trainer; or the proxy in the inference server's process (`proxy="server"`, with `server="process"`), which
    hands the server its calls without HTTP: one process and one hop fewer (`lightning.proxy.local`).
    `log_dir`: where those processes write (default: a temporary directory); `stacks_dir`: where they
    dump their stacks on SIGUSR1 (`lightning.diagnose`). `start_timeout`: the seconds both processes may take to
    answer, together (a run's `timeouts.startup`); `report` gets a line every REPORT_EVERY seconds while one starts.
    `max_body_bytes`: the largest request body either server takes (413 above it). `agents_need_token`: False lets
    agents send any key on the routes their runners hand them (`LLMProxy`'s; `TrainConfig.proxy_any_agent_key`).
    """

    def __init__(
        self,
        store: LightningStore,
        model_dir: Path,
        *,
        model_name: str = POLICY_MODEL_NAME,
        max_batch_size: int = 64,
        batch_invariant: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        server: str = "thread",
        proxy: str = "thread",
        store_url: str | None = None,
        log_dir: Path | None = None,
        stacks_dir: Path | None = None,
        start_timeout: float,
        report: Callable[[str], None] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        proxy_token: str | None = None,
        agents_need_token: bool = True,
        access_log: bool = False,
    ) -> None:
        from lightning.proxy import Backend, LLMProxy

        if server not in ("thread", "process") or proxy not in ("thread", "process", "server"):
            raise ValueError(
                f"LocalStack(server={server!r}, proxy={proxy!r}): server is 'thread' or 'process', proxy 'thread', "
                "'process' or 'server' (in the server's process)"
            )
        if proxy == "server" and server != "process":
            raise ValueError("LocalStack(proxy='server') needs server='process': the proxy runs in that process")
        if proxy != "thread" and store_url is None:
            raise ValueError(f"LocalStack(proxy={proxy!r}) needs store_url: the proxy's process opens the store itself")
        self.store = store
        self.model_name = model_name
        self.model_dir = Path(model_dir)
        """The weights a restarted inference server starts on: the latest loaded (`loaded`)."""
        self.inference_key = secrets.token_urlsafe(24)
        # The run's (`lightning.credentials.claim_proxy_token`): its runners sign their agents' routes with it.
        self.proxy_token = proxy_token or secrets.token_urlsafe(24)
        self.inference_app: Any = None
        self.proxy: LLMProxy | None = None
        self.processes: list[ServerProcess] = []
        self._inference: Any = None
        self._start_timeout = start_timeout
        self._starting_until = time.monotonic() + start_timeout
        self._report = report
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="lightning-stack-"))
        diagnosis = {STACKS_DIR: str(stacks_dir)} if stacks_dir is not None else {}
        try:
            if server == "thread":
                self.inference_url = self._start_thread(
                    model_dir, model_name, max_batch_size, batch_invariant, device, dtype, max_body_bytes
                )
            else:
                port = free_port()
                # python -m lightning.stack: the server's options and the proxy's, both served from one process.
                module = "lightning.stack" if proxy == "server" else "lightning.inference"
                command = [sys.executable, "-m", module, "--model", str(model_dir), "--port", str(port)]
                command += ["--served-model-name", model_name, "--max-batch-size", str(max_batch_size)]
                command += ["--device", device, "--dtype", dtype]
                command += ["--threads", "1"] + (["--batch-invariant"] if batch_invariant else [])
                command += ["--max-body-mb", str(max_body_bytes / 2**20)] + (["--access-log"] if access_log else [])
                env = {INFERENCE_API_KEY: self.inference_key, **diagnosis}
                name = "inference server"
                if proxy == "server":
                    proxy_port = free_port()
                    command += ["--proxy-port", str(proxy_port)]
                    command += [] if agents_need_token else ["--proxy-any-agent-key"]
                    env.update({STORE_URL: str(store_url), PROXY_TOKEN: self.proxy_token})
                    name = SERVER_WITH_PROXY
                    self.proxy_url = f"http://127.0.0.1:{proxy_port}"
                log = log_dir / "inference.log"
                self.inference_url = self._start_process(name, command, env, port, log)
            backend = f"{self.inference_url}/v1"
            if proxy == "thread":
                backends = [Backend(url=backend, api_key=self.inference_key)]
                self.proxy = LLMProxy(
                    store, backends, model_name=model_name, token=self.proxy_token,
                    agents_need_token=agents_need_token,
                    tokenizer=str(model_dir), max_body_bytes=max_body_bytes,
                )  # fmt: skip
                self.proxy_url = self.proxy.start()
            elif proxy == "process":
                port = free_port()
                command = [sys.executable, "-m", "lightning.cli", "proxy", "serve", "--backend", backend]
                command += ["--model-name", model_name, "--port", str(port)]
                command += [] if agents_need_token else ["--any-agent-key"]
                command += ["--tokenizer", str(model_dir), "--max-body-mb", str(max_body_bytes / 2**20)]
                command += ["--access-log"] if access_log else []
                env = {
                    STORE_URL: str(store_url),
                    PROXY_TOKEN: self.proxy_token,
                    BACKEND_API_KEY: self.inference_key,
                    **diagnosis,
                }
                self.proxy_url = self._start_process("LLM proxy", command, env, port, log_dir / "proxy.log")
            # The processes start side by side (each spends seconds importing its libraries), with one deadline.
            for child in self.processes:
                child.wait_until_answering(self._starting_until)
        except BaseException:
            self.close()
            raise

    @property
    def inference_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.inference_key}"}

    def loaded(self, model_dir: Path) -> None:
        """The inference server now serves `model_dir`: a restart starts it on those weights."""
        self.model_dir = Path(model_dir)
        for child in self.processes:
            if child.name in ("inference server", SERVER_WITH_PROXY):
                child.command[child.command.index("--model") + 1] = str(model_dir)

    def restart_dead(self) -> list[ServerProcess]:
        """Start again each server process that has exited or stopped answering; the ones restarted."""
        restarted = []
        for child in self.processes:
            if not child.healthy():
                child.restart()
                restarted.append(child)
        return restarted

    def serving(self) -> dict[str, Any]:
        """What the inference server serves: its weights' version and directory, device and dtype."""
        response = httpx.get(
            f"{self.inference_url}/admin/version", headers=self.inference_headers, timeout=30, verify=tls_context()
        )
        response.raise_for_status()
        return response.json()

    def _start_thread(
        self,
        model_dir: Path,
        model_name: str,
        max_batch_size: int,
        batch_invariant: bool,
        device: str,
        dtype: str,
        max_body_bytes: int,
    ) -> str:
        from lightning.inference import create_inference_app

        self.inference_app = create_inference_app(
            model_dir, served_model_name=model_name, max_batch_size=max_batch_size, api_key=self.inference_key,
            batch_invariant=batch_invariant, device=device, dtype=dtype, max_body_bytes=max_body_bytes,
        )  # fmt: skip
        self._inference = ThreadedServer(self.inference_app)
        return self._inference.start()

    def _start_process(self, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path) -> str:
        child = ServerProcess(
            name, command, env, f"http://127.0.0.1:{port}", log_path, self._start_timeout, self._report
        )
        self.processes.append(child)
        child.spawn()  # answering is waited for once every part has started (`__init__`)
        return child.url

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self._inference is not None:
            self._inference.stop()
        for child in reversed(self.processes):
            child.stop()
        self.processes.clear()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the inference server and the LLM proxy in one process --------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`python -m lightning.stack`: the embedded inference server (`python -m lightning.inference`'s options) and the
    LLM proxy in front of it in one process (a run's `inference.with_proxy`): the proxy on `--proxy-port`, storing its
    spans in the store at $LIGHTNING_STORE_URL, its token in $LIGHTNING_PROXY_TOKEN; its calls reach the model's app
    on the same event loop, without HTTP (`lightning.proxy.local`)."""
    from lightning.inference.__main__ import arguments, serve

    parser = arguments("python -m lightning.stack", main.__doc__)
    parser.add_argument("--proxy-port", type=int, required=True, help="where the LLM proxy listens")
    parser.add_argument(
        "--proxy-any-agent-key", action="store_true",
        help="the proxy takes any API key on the routes runners hand their agents (loopback only)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    token, store_url = _proxy_settings(args, parser)  # refused before the model loads
    serve(args, parser, lambda config: _serve_with_proxy(config, args, token, store_url))


def _proxy_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str | None, str]:
    """The proxy's token ($LIGHTNING_PROXY_TOKEN; needed beyond loopback) and its store's URL ($LIGHTNING_STORE_URL)."""
    token = os.environ.get(PROXY_TOKEN) or None
    if token is None and not is_loopback(args.host):
        parser.error(f"--proxy-port on {args.host}: give the proxy a token in ${PROXY_TOKEN}")
    if args.proxy_any_agent_key and not is_loopback(args.host):
        parser.error(f"--proxy-any-agent-key: only on a loopback address, not {args.host}")
    store_url = os.environ.get(STORE_URL)
    if not store_url:
        parser.error(f"the proxy stores its spans in the store at ${STORE_URL}; set it")
    return token, store_url


def _serve_with_proxy(config: Any, args: argparse.Namespace, token: str | None, store_url: str) -> None:
    """The inference app (uvicorn's `config.app`) and the LLM proxy in front of it, on one uvicorn server and event
    loop listening on both ports; the proxy hands its calls to the app in this process."""
    import uvicorn

    from lightning.proxy import Backend, LLMProxy
    from lightning.store import open_store

    app = config.app
    backend = f"http://{args.host}:{args.port}/v1"
    store = open_store(store_url, watchdog_interval=None)
    proxy = LLMProxy(
        store, [Backend(url=backend, api_key=args.api_key)], model_name=args.served_model_name or POLICY_MODEL_NAME,
        token=token, agents_need_token=not args.proxy_any_agent_key, tokenizer=args.model,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024), in_process={backend: app},
    )  # fmt: skip
    proxy.url = f"http://{args.host}:{args.proxy_port}"
    config.app = _ByPort(app, proxy.app, args.proxy_port)
    sockets = [_listening(args.host, args.port), _listening(args.host, args.proxy_port)]
    print(f"lightning.stack: the LLM proxy on {proxy.url}, spans to {store!r}", file=sys.stderr, flush=True)
    freeze_startup_objects()
    try:
        uvicorn.Server(config).run(sockets=sockets)
    finally:
        asyncio.run(store.close())


class _ByPort:
    """One ASGI app for two: requests to `proxy_port` go to the proxy, the rest (lifespan too) to the server."""

    def __init__(self, server: Any, proxy: Any, proxy_port: int) -> None:
        self.server, self.proxy, self.proxy_port = server, proxy, proxy_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        server = scope.get("server")
        if server is not None and server[1] == self.proxy_port:
            await self.proxy(scope, receive, send)
        else:
            await self.server(scope, receive, send)


def _listening(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, as uvicorn binds its own (the server listens on it once it starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    main()
