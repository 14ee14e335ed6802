"""The embedded serving parts of a run on one machine: the inference server for a model directory and the LLM
proxy in front of it, each on a thread of this process or in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from lightning.store.base import LightningStore
from lightning.types import ProxyLLM


class LocalStack:
    """The embedded serving pieces of a training run on one machine: the inference server for
    `model_dir` and the LLM proxy in front of it, storing spans in `store`.

    Each runs on a thread of this process (the default: tests reach the engine as
    `inference_app.state.engine` and the proxy as `proxy`), or in a process of its own
    (`server="process"`, `proxy="process"` with the store's `store_url`), which gives it a core of its
    own instead of sharing this process's interpreter lock with the runners and the trainer. `proxy_port`: where
    the proxy listens (0: any free port).
    """

    def __init__(
        self,
        store: LightningStore,
        model_dir: Path,
        *,
        model_name: str = "policy",
        max_batch_size: int = 64,
        server: str = "thread",
        proxy: str = "thread",
        store_url: str | None = None,
        proxy_port: int = 0,
    ) -> None:
        from lightning.proxy import LLMProxy
        from lightning.serving import free_port

        if server not in ("thread", "process") or proxy not in ("thread", "process"):
            raise ValueError(f"LocalStack(server={server!r}, proxy={proxy!r}): use 'thread' or 'process' for each")
        if proxy == "process" and store_url is None:
            raise ValueError("LocalStack(proxy='process') needs store_url: the proxy process opens the store itself")
        self.store = store
        self.model_name = model_name
        self.inference_app: Any = None
        self.proxy: LLMProxy | None = None
        self._inference: Any = None
        self._processes: list[subprocess.Popen[bytes]] = []
        if server == "thread":
            self.inference_url = self._start_thread(model_dir, model_name, max_batch_size)
        else:
            port = free_port()
            command = [sys.executable, "-m", "lightning.inference", "--model", str(model_dir), "--port", str(port)]
            command += ["--served-model-name", model_name, "--max-batch-size", str(max_batch_size), "--threads", "1"]
            self.inference_url = self._start_process(command, port)
        if proxy == "thread":
            self.proxy = LLMProxy(store, [f"{self.inference_url}/v1"], model_name=model_name)
            self.proxy_url = self.proxy.start(port=proxy_port)
        else:
            port = proxy_port or free_port()
            command = [sys.executable, "-m", "lightning.cli", "proxy", "serve", "--store", str(store_url)]
            command += ["--backend", f"{self.inference_url}/v1", "--model-name", model_name, "--port", str(port)]
            self.proxy_url = self._start_process(command, port)

    def resource(self) -> ProxyLLM:
        """The proxy as a resource for the store; runners route it to each attempt."""
        return ProxyLLM(endpoint=f"{self.proxy_url}/v1", model=self.model_name)

    def _start_thread(self, model_dir: Path, model_name: str, max_batch_size: int) -> str:
        from lightning.inference import create_inference_app
        from lightning.serving import ThreadedServer

        self.inference_app = create_inference_app(
            model_dir, served_model_name=model_name, max_batch_size=max_batch_size
        )
        self._inference = ThreadedServer(self.inference_app)
        return self._inference.start()

    def _start_process(self, command: list[str], port: int) -> str:
        url = f"http://127.0.0.1:{port}"
        # stderr goes to a file, not a pipe: nobody drains a pipe after start-up, and a full one blocks the server.
        log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server; closed with it)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        self._processes.append(process)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                error = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{' '.join(command[:4])} exited while starting: {error}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise TimeoutError(f"{' '.join(command[:4])} did not answer on {url} within 120 s")

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self._inference is not None:
            self._inference.stop()
        for process in reversed(self._processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
