"""A training run as one explicit object: `await Run.open(config)` brings up what the run needs in this process (the
store, the inference server or vLLM, the LLM proxy, the trainer process, the MLflow run), every stage of
`lightning.stages` takes the open run, and `await run.close()` brings it all down. A stage given a run that is not
open raises `RunNotOpen`; nothing starts behind the caller's back.

Where a run stands is read from one record, its checkpoints (`<output_dir>/<run_name>/checkpoints`): checkpoint
`k` holds the weights and trainer state after `k` iterations (0: the initial model after a warm start) and, in its
meta.json, the run's history up to it. The checkpoint is the record because it is the one thing a resume cannot
redo cheaply, and because it is written atomically with the weights, the history can never disagree with them.
Everything else is derived from the store and kept idempotent: enqueuing an iteration's rollouts again returns the
same rollouts (idempotency keys), so an interrupted iteration or evaluation picks up where it was; MLflow is a view
that `open` fills in from the history when a metric is missing.

A run owns one queue of the store, named after it: its runners take only its rollouts, so runs that share a store
(a `train` and a `dev` run, two trainings) never touch each other's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, PrivateAttr

from lightning import owner, stopping
from lightning.config import TrainConfig, load_tasks, missing_data
from lightning.credentials import claim_proxy_token
from lightning.diagnose import collect_stacks, dump_stacks_on_signal
from lightning.environment import VLLM_PYTHON
from lightning.errors import ConfigError
from lightning.serving import tls_context
from lightning.store import lifecycle
from lightning.store.base import LightningStore
from lightning.types import ProxyLLM

logger = logging.getLogger(__name__)


class RunNotOpen(RuntimeError):
    """A stage was given a run that is not open in this process."""


class ServingError(RuntimeError):
    """A serving part of the run (inference server, LLM proxy) failed; the message names it and its address."""


class Endpoints(BaseModel):
    """Where a run's serving parts answer."""

    proxy_url: str
    """The LLM proxy, without /v1."""
    model_name: str
    inference_urls: list[str] = []
    """Embedded servers that load each new checkpoint (base URLs)."""


@dataclass
class _Parts:
    """What an open run holds in this process."""

    store: LightningStore
    model_dir: Path | None
    """The initial policy (the trainer's KL reference); None until first asked for when the run serves an endpoint
    it did not start and does not train (`Run.model_dir` prepares it then)."""
    trainer: Any = None
    tracker: Any = None
    trace_writer: Any = None
    """The thread that writes the run's training traces to MLflow in the background (`mlflow_traces.TraceWriter`),
    started on the first traces."""
    stack: Any = None
    runner_processes: Any = None
    """The run's runner processes (task_runner processes: `lightning.runner.processes`), started when first asked."""
    vllm: list[Any] = field(default_factory=list)
    """The vLLM servers this run started (inference.backend vllm), one per replica."""
    closers: list[Any] = field(default_factory=list)
    tokenizer: Any = None
    supervisor: Any = None
    serving_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the serving parts change: weights swapped in, a dead part restarted."""
    weight_version: int = 0
    """The checkpoint step the inference servers serve."""
    adapter: str | None = None
    """A LoRA run on vLLM: the name the replicas serve checkpoint `weight_version`'s adapter under, which the proxy
    sends the policy's calls to (None: the base model, or whole weights)."""
    last_progress: float = field(default_factory=time.monotonic)
    progress_note: str = "the run opened"
    proxy_token: str | None = None
    """The bearer token of the run's own LLM proxy (random per run unless $LIGHTNING_PROXY_TOKEN names one)."""
    inference_headers: dict[str, str] = field(default_factory=dict)
    """What the run's own embedded inference server wants on admin calls (its random per-run key)."""
    datasets: dict[str, list[Any]] = field(default_factory=dict)
    iterations: dict[str, set[int]] = field(default_factory=dict)
    """The training iterations that reached each phase in this process: "begun" (the flow's iteration started),
    "collected" (its rollouts are all in: `stages.collect_rollouts` says so at its end)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One row per trained iteration (`reporting.iteration_row`), as the latest checkpoint records it."""
    lock: Any = None
    """The run directory's owner lock, when this open took it (`lightning.owner`)."""


class Run(BaseModel):
    """An open training run. As a Prefect parameter it shows (and is stored) as its config and endpoints; sent to
    another process (a runner task on a Ray worker) it arrives with those only, and `connect_store` opens a store
    connection of its own there."""

    config: TrainConfig
    endpoints: Endpoints
    queue: str
    """The store queue of this run's rollouts: the run's name, or a queue of its own for a `dev` or `evaluate`
    flow that works beside a training run of the same name."""
    _parts: _Parts | None = PrivateAttr(default=None)

    # --- names and paths ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.run_name

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def checkpoints_dir(self) -> Path:
        return checkpoints_dir(self.config)

    def resources_id(self, mode: str) -> str:
        """The id of the run's LLM resources for `mode` (train or val): one per queue and mode, updated in place, so a
        rollout enqueued by an earlier process of the run reaches this process's proxy (`Run.open` points them there
        before anything runs). Per queue: a `dev` or `evaluate` flow beside a training run never points the
        training's rollouts at its own proxy. (A training run's queue is its name, as the id's key was before.)"""
        digest = hashlib.sha256(f"{self.queue}/{mode}".encode()).hexdigest()[:24]
        return f"rs-run-{digest}-{mode}"

    def llm(self, mode: str) -> ProxyLLM:
        """The run's LLM resource for `mode` (train or val): this process's proxy, with the mode's sampling
        parameters (`lightning.stages.update_resources` stores it under the run's resources id). It holds no key:
        the proxy's token stays out of the store; runners give agents the one in their environment
        ($LIGHTNING_PROXY_TOKEN), as they read the store's token (`lightning.runner.Runner`)."""
        config = self.config
        sampling = config.eval_sampling if mode == "val" else config.sampling
        return ProxyLLM(
            endpoint=self._proxy_endpoint(), model=self.endpoints.model_name, sampling_parameters=sampling,
        )  # fmt: skip

    def _proxy_endpoint(self) -> str:
        return f"{self.endpoints.proxy_url}/v1"

    # --- what only an open run has -----------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._parts is not None

    def _open_parts(self) -> _Parts:
        if self._parts is None:
            raise RunNotOpen(
                f"run {self.name!r} is not open in this process: open it with `await Run.open(config)` (the flows "
                "do) and pass that run to the stages"
            )
        return self._parts

    @property
    def store(self) -> LightningStore:
        return self._open_parts().store

    @property
    def model_dir(self) -> Path:
        parts = self._open_parts()
        if parts.model_dir is None:
            parts.model_dir = prepare_model(self.config)
        return parts.model_dir

    @property
    def trainer(self) -> Any:
        trainer = self._open_parts().trainer
        if trainer is None:
            raise RunNotOpen(f"run {self.name!r} was opened without a trainer (train=False): it cannot train")
        return trainer

    @property
    def tracker(self) -> Any:
        """The MLflow run (None when the run was opened without training)."""
        return self._open_parts().tracker

    @property
    def trace_writer(self) -> Any:
        """The run's background writer of MLflow traces (`lightning.mlflow_traces.TraceWriter`), started on first use;
        None when the run has no MLflow run."""
        parts = self._open_parts()
        if parts.trace_writer is None and parts.tracker is not None:
            from lightning.mlflow_traces import TraceWriter

            parts.trace_writer = TraceWriter(parts.tracker)
        return parts.trace_writer

    def flush_traces(self) -> None:
        """Block until every trace handed to the run's writer is in MLflow (or logged as failed)."""
        parts = self._open_parts()
        if parts.trace_writer is not None:
            parts.trace_writer.flush()

    @property
    def vllm_servers(self) -> list[Any]:
        return self._open_parts().vllm

    @property
    def history(self) -> list[dict[str, Any]]:
        return self._open_parts().history

    @property
    def proxy_token(self) -> str | None:
        """The run's own LLM proxy's bearer token (None for a proxy the run did not start: `proxy_endpoint`)."""
        return self._open_parts().proxy_token

    @property
    def inference_headers(self) -> dict[str, str]:
        return self._open_parts().inference_headers

    def tokenizer(self) -> Any:
        """The policy's tokenizer, loaded once per open run."""
        parts = self._open_parts()
        if parts.tokenizer is None:
            from transformers import AutoTokenizer

            parts.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return parts.tokenizer

    def dataset(self, field_name: str) -> list[Any]:
        """The tasks of `train_data` or `val_data`, loaded once per open run."""
        parts = self._open_parts()
        if field_name not in parts.datasets:
            spec = getattr(self.config, field_name)
            if spec is None:
                raise ConfigError(missing_data(field_name))
            parts.datasets[field_name] = load_tasks(spec, field_name)
        return parts.datasets[field_name]

    @contextlib.asynccontextmanager
    async def connect_store(self) -> AsyncIterator[LightningStore]:
        """The run's store: the open run's own, or, in a process the run was sent to (a Ray worker), a connection
        of this process's for the duration."""
        if self._parts is not None:
            yield self._parts.store
            return
        from lightning.store import open_store

        store = open_store(self.config.store_url, watchdog_interval=None)
        try:
            yield store
        finally:
            await store.close()

    def completed_iterations(self) -> int:
        """Iterations trained so far: the step of the latest checkpoint (the run resumes at this iteration)."""
        return self.latest_step() or 0

    def latest_step(self) -> int | None:
        """The step of the latest checkpoint: None before any (0 after a warm start, k after k iterations)."""
        return latest_step(self.config)

    # --- weights: what the inference servers serve (the one place that changes it) -------------------------

    async def load_weights(self, path: str | Path, step: int) -> None:
        """Have every inference server of the run serve checkpoint `step` at `path`: the run's proxy paused and its
        calls in flight drained around the swap, so no rollout mixes two weight versions; spans from then on record
        version `step`. Embedded servers reload through `/admin/reload`, vLLM replicas in place (woken first if they
        slept through the update); a server the supervisor restarts later starts on these weights, and it restarts
        nothing meanwhile, so a swap is never cut in two. A LoRA checkpoint (an adapter directory) reaches vLLM
        replicas as the adapter alone, never as whole weights: each loads it under a new name, the proxy routes the
        policy's calls to that name (spans record it too), then the previous adapter is unloaded
        (`lightning.inference.vllm.publish_lora_adapter`)."""
        parts = self._open_parts()
        config = self.config
        async with self._serving_parts_held():
            own_proxy = not config.proxy_endpoint
            if own_proxy:
                await asyncio.to_thread(self.proxy_admin, "pause", None, config.timeouts.checkpoint)
            client = httpx.AsyncClient(
                timeout=config.timeouts.checkpoint, headers=parts.inference_headers, verify=tls_context()
            )
            async with client as http:
                for server in self.endpoints.inference_urls:
                    try:
                        response = await http.post(f"{server}/admin/reload", json={"path": str(path), "version": step})
                        response.raise_for_status()
                    except httpx.HTTPError as exc:
                        raise ServingError(
                            f"inference server at {server}: loading checkpoint {path} failed: {exc!r}"
                        ) from exc
            parts.weight_version = step
            if parts.stack is not None:
                parts.stack.loaded(Path(path))
            adapter = bool(parts.vllm) and _holds_adapter(path)
            for server in parts.vllm:
                if config.inference.weight_sync == "sleep" and await asyncio.to_thread(server.is_sleeping):
                    await asyncio.to_thread(server.wake_up)
                if not adapter:
                    await asyncio.to_thread(server.reload_weights, str(path), str(step))
            if adapter:
                from lightning.inference.vllm import publish_lora_adapter

                def route(name: str) -> None:  # every replica has the new adapter: calls go to it from now on
                    parts.adapter = name
                    if own_proxy:
                        self.proxy_admin("resume", self._served())

                await asyncio.to_thread(
                    publish_lora_adapter, parts.vllm, path, step, route, model_name=config.inference.served_model_name
                )
            else:
                parts.adapter = None
                if own_proxy:
                    await asyncio.to_thread(self.proxy_admin, "resume", self._served())

    async def release_weights(self) -> None:
        """Before an update: colocated vLLM replicas (weight_sync: sleep) release their GPU memory to the trainer,
        new calls held at the proxy; `load_weights` wakes them on the new checkpoint. Otherwise nothing."""
        config = self.config
        if not (self.vllm_servers and config.inference.weight_sync == "sleep"):
            return
        await asyncio.to_thread(self.proxy_admin, "pause", None, config.timeouts.checkpoint)
        for server in self.vllm_servers:
            await asyncio.to_thread(server.sleep, 1)

    @contextlib.asynccontextmanager
    async def _serving_parts_held(self) -> AsyncIterator[None]:
        """While held, the supervisor restarts nothing."""
        lock = self._open_parts().serving_lock
        await asyncio.to_thread(lock.acquire)
        try:
            yield
        finally:
            lock.release()

    def runner_processes(self) -> Any:
        """The run's runner processes (task_runner processes: `lightning.runner.processes.RunnerProcesses`); each
        child starts when a runner task first needs it, and all end when the run closes."""
        processes = self._open_parts().runner_processes
        if processes is None:
            raise RunNotOpen(f"run {self.name!r} has no runner processes: its task_runner is {self.config.task_runner}")
        return processes

    def served_iterations(self) -> int:
        """Iterations trained whose weights the inference servers serve now: one past the last row of the history,
        which the checkpoint stage writes once the checkpoint is saved and loaded (`completed_iterations` counts a
        checkpoint from when its files exist)."""
        return max((row["iteration"] + 1 for row in self.history), default=0)

    def note_iteration(self, iteration: int, phase: Literal["begun", "collected"]) -> None:
        """Training iteration `iteration` reached `phase` in this process: "begun" (its flow started), "collected"
        (its rollouts are all in)."""
        if self._parts is not None:
            self._parts.iterations.setdefault(phase, set()).add(iteration)

    def iteration_reached(self, iteration: int, phase: Literal["begun", "collected"]) -> bool:
        return iteration in self._open_parts().iterations.get(phase, set())

    def made_progress(self, what: str) -> None:
        """A stage finished, or a rollout: the run is not stuck (the supervisor warns when nothing finishes for
        `timeouts.stall_warning` seconds)."""
        if self._parts is not None:
            self._parts.last_progress = time.monotonic()
            self._parts.progress_note = what

    def check_serving(self) -> None:
        """Raise ServingError if a serving part died more often than it may be restarted."""
        supervisor = self._open_parts().supervisor
        if supervisor is not None and supervisor.failure is not None:
            raise ServingError(supervisor.failure)

    async def serving_answers(self, timeout: float) -> None:
        """Wait until every serving process of the run answers (a dead one is being restarted by the supervisor);
        raise ServingError if one does not within `timeout` seconds, or is past its restarts."""
        parts = self._open_parts()
        children = [] if parts.stack is None else parts.stack.processes
        deadline = time.monotonic() + timeout
        while True:
            self.check_serving()
            silent = [child for child in children if not await asyncio.to_thread(child.answers, 2.0)]
            if not silent:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"the {child.name} at {child.url}" for child in silent)
                raise ServingError(f"{names} did not answer for {timeout:g} s (see {self.run_dir / 'logs'})")
            await asyncio.sleep(0.5)

    def restarts(self) -> int:
        """Restarts of the run's serving parts so far (this process), each counted as it begins: an iteration in
        which a part died records it, though the part (a vLLM replica takes a minute or more) may still be starting
        again when the iteration's row is written."""
        parts = self._open_parts()
        stack = [] if parts.stack is None else parts.stack.processes
        return sum(child.restarts for child in stack) + sum(server.restarts for server in parts.vllm)

    def _served(self) -> dict[str, Any]:
        """What the run's proxy records on every span and routes the policy's calls to (`proxy_admin("resume", ...)`):
        the checkpoint step the inference servers serve and, for a LoRA run on vLLM, the adapter's name."""
        parts = self._open_parts()
        return {"weight_version": parts.weight_version, "adapter": parts.adapter}

    def proxy_admin(self, action: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        """POST /admin/<action> to the run's own LLM proxy: `pause` holds new calls and waits for the ones in flight,
        `resume` lets calls through and records `weight_version` (and `adapter`, the LoRA adapter calls go to) on
        every span from then on."""
        token = self.proxy_token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        url = f"{self.endpoints.proxy_url}/admin/{action}"
        try:
            response = httpx.post(url, json=body or {}, headers=headers, timeout=timeout + 5, verify=tls_context())
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ServingError(f"the run's LLM proxy at {self.endpoints.proxy_url}: {action} failed: {exc!r}") from exc
        return response.json()

    def __getstate__(self) -> dict[str, Any]:
        # What crosses to another process is the config and the endpoints; servers, processes and connections stay.
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {"_parts": None}}

    # --- opening and closing -----------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        config: TrainConfig,
        *,
        train: bool = True,
        weights: str | None = None,
        queue: str | None = None,
        mlflow_tags: dict[str, str] | None = None,
        track: bool | None = None,
        report: Callable[[str], None] | None = None,
    ) -> Run:
        """Bring the run up in this process: the store, the serving parts on the latest weights (or on the
        checkpoint `weights`) and, with `train`, the trainer process and the MLflow run (`track`: the MLflow run
        alone, or not; default: with `train`; a run that trains untracked keeps its metrics in its checkpoints' history
        only), tagged with `mlflow_tags` besides its source commit and user (the flows add their flow run's URL).
        `queue`: the store queue of its rollouts (default: the run's name). Rollouts an earlier process left running
        in that queue are requeued: from now on this process owns it. First, what can be checked in seconds is
        (`preflight`, unless the command that opened it just did): a missing dataset or an agent that does not import
        is one clear error, before any server starts. Starting the servers takes at most `timeouts.startup`; `report`
        (a flow's logger) gets a line every few seconds while one is still starting. A run that fails to open ends its
        MLflow run FAILED, with the error."""
        from lightning import preflight

        if track is False and config.checkpoint.register_model:
            raise ValueError(
                "checkpoint.register_model registers the final model in MLflow, and this run is opened with "
                "track=False (no MLflow run); set checkpoint.register_model to null, or open it tracked"
            )
        await asyncio.to_thread(preflight.check, config, training=train)
        config.run_dir.mkdir(parents=True, exist_ok=True)
        # One run, one owner: a second training of this run_name is refused here while the first lives (a command that
        # took the lock already holds it: `lightning.owner`).
        lock = owner.acquire(config.run_dir, config.run_name) if train else None
        try:
            return await cls._open(config, train, weights, queue, mlflow_tags, track, report, lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    async def _open(
        cls,
        config: TrainConfig,
        train: bool,
        weights: str | None,
        queue: str | None,
        mlflow_tags: dict[str, str] | None,
        track: bool | None,
        report: Callable[[str], None] | None,
        lock: Any,
    ) -> Run:
        dump_stacks_on_signal(config.run_dir / "stacks", "flow")
        # A run that neither trains nor serves the model itself (an external endpoint, a running server) builds or
        # checks no model before a stage asks for it (a tokenizer for the adapter).
        serves_model = not (config.proxy_endpoint or config.inference.endpoint)
        model_dir = await asyncio.to_thread(prepare_model, config) if train or serves_model else None
        from lightning.checkpoint import verified_latest_checkpoint

        # Checksums checked here, once: a damaged newest checkpoint is set aside and the run resumes before it.
        latest = await asyncio.to_thread(verified_latest_checkpoint, checkpoints_dir(config))
        serving_dir = Path(weights) if weights else latest or model_dir or Path(config.model)
        parts = _Parts(store=open_run_store(config), model_dir=model_dir, lock=lock)
        endpoints = Endpoints(proxy_url="", model_name=config.inference.served_model_name)
        run = cls(config=config, endpoints=endpoints, queue=queue or config.run_name)
        run._parts = parts
        if config.task_runner == "processes":
            from lightning.runner.processes import FleetSpec, RunnerProcesses

            fleet = FleetSpec(config.store_url, config.agent, run.queue, config.runner_concurrency)
            parts.runner_processes = RunnerProcesses(
                fleet, start_timeout=config.timeouts.startup, stacks_dir=config.run_dir / "stacks"
            )
        # The MLflow run first, beside the rest: a run that fails to open still leaves one, FAILED, saying why.
        tracking = None
        if train if track is None else track:
            tracking = asyncio.create_task(asyncio.to_thread(_start_tracker, config, mlflow_tags))
        try:
            parts.history = recorded_history(config)
            await requeue_orphans(parts.store, run.queue)
            if train:  # the trainer process loads torch and the model while the servers come up
                parts.trainer = _trainer(config, run.model_dir)
                parts.closers.append(parts.trainer.close)
                trainer_ready = asyncio.create_task(asyncio.to_thread(parts.trainer.start))
            run.endpoints = await asyncio.to_thread(_start_serving, config, parts, serving_dir, report)
            if tracking is not None:
                parts.tracker = await tracking
                await asyncio.to_thread(_log_history, parts.tracker, parts.history)
            if train:
                await asyncio.wait_for(trainer_ready, timeout=config.timeouts.startup)
            parts.weight_version = serving_step(config, weights)
            if parts.vllm and _holds_adapter(serving_dir):  # the replicas started on its base: the adapter now
                from lightning.inference.vllm import publish_lora_adapter

                parts.adapter = await asyncio.to_thread(
                    publish_lora_adapter, parts.vllm, serving_dir, parts.weight_version, lambda name: None,
                    model_name=config.inference.served_model_name,
                )  # fmt: skip
            if not config.proxy_endpoint:  # every span from now on records the weights that produced it
                await asyncio.to_thread(run.proxy_admin, "resume", run._served())
            # Before any runner of this process claims anything: what an earlier process left unfinished (requeued
            # above) calls this process's proxy, not the dead one's port.
            await point_resources_here(run)
            parts.supervisor = Supervisor(run, max_restarts=config.inference.max_restarts)
        except BaseException as exc:
            if tracking is not None and parts.tracker is None:
                with contextlib.suppress(BaseException):
                    parts.tracker = await tracking
            if parts.tracker is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(parts.tracker.log_failure, f"opening the run failed: {exc!r}")
            parts.lock = None  # released by `open`, which took it
            await run.close("FAILED")
            raise
        # What the imports and the opening made lives as long as the run: out of the collector's full passes until
        # `close` (a full pass over the flow's 650,000 objects took 260 ms, each few iterations: 0.2 ms of this
        # process's CPU a rollout, docs/benchmarks.md "The run's process"). Frozen as it is, without a full pass
        # first (a second in a test process's heap): what is garbage already is collected after `close`.
        gc.freeze()
        return run

    async def close(self, status: str = "FINISHED") -> None:
        """Bring down what `open` brought up; `status` ends the MLflow run (FINISHED, FAILED, KILLED)."""
        parts = self._parts
        if parts is None:
            return
        if parts.supervisor is not None:  # first: nothing is restarted while the parts go down
            await asyncio.to_thread(parts.supervisor.stop)
        self._parts = None
        if parts.runner_processes is not None:  # the runners stop before the store and servers they use
            await asyncio.to_thread(parts.runner_processes.close)
        if parts.trace_writer is not None:  # every trace submitted reaches MLflow before its run ends
            await asyncio.to_thread(parts.trace_writer.close)
        if parts.tracker is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(parts.tracker.end, status)
        for close in reversed(parts.closers):
            try:
                await asyncio.to_thread(close)
            except Exception:
                logger.exception("shutting down %s failed", close)
        await parts.store.close()
        if parts.lock is not None:
            parts.lock.release()
        gc.unfreeze()  # what `open` froze is the collector's again: this process may go on without the run


# --- supervision -----------------------------------------------------------------------------------------


class Supervisor:
    """A thread of the open run that restarts a serving process (the embedded inference server, the LLM proxy, a
    vLLM replica) that has exited or stopped answering, on its port and on the weights being served, at most
    `max_restarts` times each; each restart is logged, and counted in the iteration's metrics (`restarts`). Once
    a part has used up its restarts, `failure` says which and where, and the next rollout phase fails with it.
    When nothing has finished (a stage, a rollout) for `timeouts.stall_warning` seconds, it logs the stacks of the
    run's processes (`lightning.diagnose`) and how to get them again."""

    def __init__(self, run: Run, *, max_restarts: int, interval: float = 1.0) -> None:
        self.run = run
        self.max_restarts = max_restarts
        self.interval = interval
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="run-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval) and self.failure is None:
            parts = self.run._parts
            if parts is None:
                return
            try:
                with parts.serving_lock:
                    self._check(parts)
            except stopping.RunStopped:  # a restart cut short by the run's stop: the run stops its servers itself
                return
            except Exception as exc:
                self.failure = f"restarting the run's serving parts failed: {exc}"
                logger.exception(self.failure)
            self._check_stall(parts)

    def _check_stall(self, parts: _Parts) -> None:
        stalled = time.monotonic() - parts.last_progress
        if stalled < self.run.config.timeouts.stall_warning:
            return
        stacks = collect_stacks(self.run.run_dir / "stacks")
        logger.warning(
            "run %s: nothing has finished for %.0f s (the last: %s). Stacks of its processes follow; `lightning debug "
            "stacks %s` takes them again, into %s.\n%s", self.run.name, stalled, parts.progress_note,
            self.run.run_dir, self.run.run_dir / "stacks", stacks,
        )  # fmt: skip
        parts.last_progress = time.monotonic()  # the next warning after another stall_warning seconds

    def _check(self, parts: _Parts) -> None:
        from lightning.stack import SERVER_WITH_PROXY

        if parts.stack is not None:
            for child in parts.stack.processes:
                # A run that is stopping stops its servers itself: none of them is restarted then.
                if self._stop.is_set() or stopping.stop_requested() or child.healthy():
                    continue
                if child.restarts >= self.max_restarts:
                    self.failure = (
                        f"the {child.name} at {child.url} died or hung again after {child.restarts} restarts "
                        f"(inference.max_restarts); the end of its log {child.log_path}:\n{child.log_tail()}"
                    )
                    return
                code = None if child.process is None else child.process.poll()
                logger.warning(
                    "the %s at %s %s; restarting it (restart %d of at most %d)", child.name, child.url,
                    "stopped answering" if code is None else f"exited with code {code}", child.restarts + 1,
                    self.max_restarts,
                )  # fmt: skip
                child.restart()
                if child.name in ("LLM proxy", SERVER_WITH_PROXY):  # a new proxy starts at no weight version
                    self.run.proxy_admin("resume", self.run._served())
        for server in parts.vllm:
            if not (self._stop.is_set() or stopping.stop_requested()) and server.restart_if_dead():
                logger.warning("vLLM at %s exited; restarted it (restart %d)", server.base_url, server.restarts)


# --- the record: checkpoints -------------------------------------------------------------------------------


def checkpoints_dir(config: TrainConfig) -> Path:
    return config.run_dir / "checkpoints"


def latest_step(config: TrainConfig) -> int | None:
    """The step of the run's latest checkpoint (None: it has none). A run resumes at iteration `step`."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint

    latest = latest_checkpoint(checkpoints_dir(config))
    return None if latest is None else load_checkpoint(latest).step


def recorded_history(config: TrainConfig) -> list[dict[str, Any]]:
    """The run's history as its latest checkpoint records it: one row per trained iteration."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint

    latest = latest_checkpoint(checkpoints_dir(config))
    return [] if latest is None else list(load_checkpoint(latest).meta.get("history", []))


def serving_step(config: TrainConfig, checkpoint: str | None = None) -> int:
    """The step of `checkpoint` (default: the run's latest; 0 when it has none, the initial model)."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint

    path = Path(checkpoint) if checkpoint else latest_checkpoint(checkpoints_dir(config))
    return 0 if path is None else load_checkpoint(path).step


STOPPED = "stopped"
"""The metadata key on a rollout that a graceful stop cancelled (`lightning.stages.cancel_for_stop`): the run's
next process requeues it."""


async def requeue_orphans(store: LightningStore, queue: str) -> int:
    """Take over what an earlier process of the run left in its queue: rollouts whose attempt was left preparing or
    running (the process was killed mid-iteration), with nobody to finish it, are requeued and that attempt marked
    unresponsive; rollouts a graceful stop cancelled are requeued. Call it only when no runner of the run is alive;
    `point_resources_here` then points what they carry at this process's proxy. Returns how many it requeued."""
    orphans = await store.query_rollouts(queue=queue, status_in=sorted(lifecycle.ACTIVE_ROLLOUT))
    for rollout in orphans:
        await store.update_attempt(rollout.rollout_id, "latest", status="unresponsive")
        await store.update_rollout(rollout.rollout_id, status="requeuing")
    if orphans:
        logger.warning("requeued %d rollouts an earlier process of run %s left running", len(orphans), queue)
    cancelled = await store.query_rollouts(queue=queue, status_in=["cancelled"])
    stopped = [rollout for rollout in cancelled if (rollout.metadata or {}).get(STOPPED)]
    for rollout in stopped:
        metadata = {key: value for key, value in rollout.metadata.items() if key != STOPPED}
        await store.update_rollout(rollout.rollout_id, status="requeuing", metadata=metadata)
    if stopped:
        logger.warning(
            "requeued %d rollouts that the stop of an earlier process of run %s cancelled", len(stopped), queue
        )
    return len(orphans) + len(stopped)


async def point_resources_here(run: Run) -> int:
    """Point the LLM resource (`llm_resource_name`, the run's proxy) of the run's resources, and of those the
    unfinished rollouts of its queue carry (prompt optimisation's candidates), at this process's proxy and token,
    their sampling parameters kept: a rollout an earlier process of the run enqueued, or that its stop cancelled and
    `requeue_orphans` requeued, would otherwise call that process's proxy, gone with it, and fail (its port refuses:
    `ClientConnectorError`). Call it once the serving parts are up and before any runner of the run claims. How many
    resources it changed."""
    store, name = run.store, run.config.llm_resource_name
    unfinished = await store.query_rollouts(
        queue=run.queue, status_in=sorted(lifecycle.QUEUED_ROLLOUT | lifecycle.ACTIVE_ROLLOUT)
    )
    ids = {run.resources_id("train"), run.resources_id("val")}
    ids |= {rollout.resources_id for rollout in unfinished if rollout.resources_id}
    endpoint = run._proxy_endpoint()
    changed = 0
    for resources_id in sorted(ids):
        stored = await store.get_resources_by_id(resources_id)
        llm = None if stored is None else stored.resources.get(name)
        if stored is None or not isinstance(llm, ProxyLLM) or (llm.endpoint, llm.api_key) == (endpoint, None):
            continue
        # No key: one stored by an earlier version (the proxy's token) is dropped; runners read it from their env.
        moved = llm.model_copy(update={"endpoint": endpoint, "api_key": None})
        await store.update_resources(resources_id, {**stored.resources, name: moved})
        changed += 1
    if changed:
        logger.info(
            "run %s: %d resources of its queue point at this process's proxy %s now", run.name, changed, endpoint
        )
    return changed


# --- bringing the parts up -------------------------------------------------------------------------------


def prepare_model(config: TrainConfig) -> Path:
    """The initial policy's directory: `config.model`, or the tiny local model built once into the run directory."""
    if config.model != "tiny":
        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model: {path} is not a Hugging Face model directory (no config.json); give a local model "
                "directory or `tiny`"
            )
        return path
    import shutil
    import tempfile

    from lightning.models import build_tiny_model

    path = config.run_dir / "model"
    if not (path / "config.json").is_file():
        # Built aside and renamed into place: a `dev` flow opening the same run at the same moment sees all or none.
        building = Path(tempfile.mkdtemp(prefix=".model-", dir=config.run_dir))
        tiny = config.tiny_model
        build_tiny_model(building, seed=config.seed, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers,
                         extra_corpus=tiny.tokenizer_corpus, init_std=tiny.init_std)  # fmt: skip
        try:
            building.rename(path)
        except OSError:  # the other process won; its model is the same (same seed)
            shutil.rmtree(building, ignore_errors=True)
    return path


def open_run_store(config: TrainConfig) -> LightningStore:
    from lightning.store import open_store

    if config.store_url.startswith("sqlite:///"):
        Path(config.store_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return open_store(config.store_url)


def _start_serving(
    config: TrainConfig, parts: _Parts, serving_dir: Path, report: Callable[[str], None] | None = None
) -> Endpoints:
    inference = config.inference
    name = inference.served_model_name
    if config.proxy_endpoint:
        return Endpoints(proxy_url=config.proxy_endpoint.rstrip("/"), model_name=name)
    if inference.backend == "embedded" and inference.endpoint is None:
        from lightning.stack import LocalStack

        in_memory = config.store_url in ("sqlite://", "sqlite:///:memory:")  # only this process sees that store
        parts.proxy_token, release_token = claim_proxy_token()
        parts.closers.append(release_token)
        parts.stack = LocalStack(
            parts.store, serving_dir, model_name=name, max_batch_size=inference.max_batch_size,
            batch_invariant=config.deterministic, device=inference.device, dtype=inference.dtype,
            server="thread" if inference.in_process else "process",
            proxy=_proxy_place(config, in_memory), store_url=config.store_url,
            log_dir=config.run_dir / "logs", stacks_dir=config.run_dir / "stacks",
            start_timeout=config.timeouts.startup, report=report,
            max_body_bytes=int(inference.max_request_mb * 2**20), proxy_token=parts.proxy_token,
            agents_need_token=not config.proxy_any_agent_key, access_log=inference.access_log,
        )  # fmt: skip
        parts.closers.append(parts.stack.close)
        served = parts.stack.serving()
        logger.info(
            "run %s: the embedded inference server at %s serves %s on %s in %s", config.run_name,
            parts.stack.inference_url, served["path"], served["device"], served["dtype"],
        )  # fmt: skip
        parts.inference_headers = parts.stack.inference_headers
        return Endpoints(proxy_url=parts.stack.proxy_url, model_name=name, inference_urls=[parts.stack.inference_url])
    from lightning.proxy import Backend, LLMProxy

    if inference.backend == "vllm" and inference.endpoint is None:
        parts.vllm = _start_vllm(config, serving_dir)
        parts.closers.extend(server.stop for server in parts.vllm)
        # The proxy reads tool calls itself only in the Hermes form (vLLM's parser named in the replicas' extra_args).
        arguments = list(inference.vllm.get("extra_args") or [])
        flag = "--tool-call-parser"
        parser = arguments[arguments.index(flag) + 1] if flag in arguments[:-1] else None
        form = "hermes" if parser in (None, "hermes") else None
        backends = [
            Backend(url=server.endpoint, api_key=_vllm_key(server), tool_call_format=form) for server in parts.vllm
        ]
    else:
        api_key = os.environ.get(inference.api_key_env) if inference.api_key_env else None
        backends = [Backend(url=str(inference.endpoint), api_key=api_key)]
    parts.proxy_token, release_token = claim_proxy_token()
    parts.closers.append(release_token)
    # Every call needs the token, unless the config lets agents send their own key on their signed routes (loopback
    # only: agent-lightning's habit); the admin routes need it always.
    need_token = not config.proxy_any_agent_key
    # The policy's tokenizer (it does not change with the weights): multi-turn calls go to the backends token-exactly.
    tokenizer = str(serving_dir) if inference.endpoint is None else None
    proxy = LLMProxy(
        parts.store, backends, model_name=name, token=parts.proxy_token, agents_need_token=need_token,
        tokenizer=tokenizer, max_body_bytes=int(inference.max_request_mb * 2**20),
    )  # fmt: skip
    proxy_url = proxy.start(host=config.proxy_host)
    parts.closers.append(proxy.stop)
    return Endpoints(proxy_url=proxy_url, model_name=name)


def _proxy_place(config: TrainConfig, in_memory: bool) -> str:
    """Where the run's LLM proxy runs beside the embedded server (`LocalStack`'s `proxy`): on a thread of this
    process (asked for, or needed by a store only this process sees), in the server's process, or in its own."""
    if config.proxy_in_process or in_memory:
        return "thread"
    return "server" if config.inference.with_proxy else "process"


def _holds_adapter(path: str | Path) -> bool:
    """`lightning.checkpoint.is_adapter_dir`, without importing torch here."""
    from lightning.checkpoint import is_adapter_dir

    return is_adapter_dir(path)


def _vllm_key(server: Any) -> str | None:
    key = server.config.api_key
    return None if key is None else key.get_secret_value()


def _start_vllm(config: TrainConfig, serving_dir: Path) -> list[Any]:
    """`inference.replicas` vLLM servers on the policy, started together and waited for; replica i gets its own
    GPUs when `gpus_per_replica` is set. With LoRA (`algorithm.lora`, or an adapter directory to serve) they start
    on the base model with vLLM's LoRA support on, sized for the run's rank; `Run.open` loads the adapter."""
    from lightning.checkpoint import ADAPTER_CONFIG, adapter_base_model
    from lightning.inference.vllm import VllmConfig, VllmServer, max_lora_rank_for
    from lightning.serving import free_port

    inference = config.inference
    lora_rank = config.algorithm.lora.rank if config.algorithm.lora is not None else None
    if _holds_adapter(serving_dir):
        adapter_rank = json.loads((serving_dir / ADAPTER_CONFIG).read_text())["r"]
        lora_rank = max(lora_rank or 0, adapter_rank)
        serving_dir = adapter_base_model(serving_dir)
    servers = []
    for replica in range(inference.replicas):
        options = dict(inference.vllm)
        if "python" not in options and "executable" not in options and os.environ.get(VLLM_PYTHON):
            options["python"] = os.environ[VLLM_PYTHON]
        if inference.gpus_per_replica:
            first = replica * inference.gpus_per_replica
            devices = ",".join(str(first + i) for i in range(inference.gpus_per_replica))
            options["env"] = {**options.get("env", {}), "CUDA_VISIBLE_DEVICES": devices}
        if inference.weight_sync == "sleep":
            options["enable_sleep_mode"] = True
        if inference.dtype != "auto":
            options.setdefault("dtype", inference.dtype)
        if config.deterministic:  # vLLM's batch-invariant kernels (GPU): a sequence's numerics ignore its batch
            options["env"] = {**options.get("env", {}), "VLLM_BATCH_INVARIANT": "1"}
        if lora_rank is not None:
            options["enable_lora"] = True
            options.setdefault("max_lora_rank", max_lora_rank_for(lora_rank))
        options.setdefault("api_key", secrets.token_urlsafe(24))  # a random key of the run's unless one is given
        vllm_config = VllmConfig(
            model=str(serving_dir), served_model_name=inference.served_model_name, port=free_port(), **options
        )
        server = VllmServer(vllm_config, log_path=config.run_dir / f"vllm-{replica}.log")
        server.start()
        servers.append(server)
    for server in servers:
        server.wait_ready(config.timeouts.startup)
    return servers


def _trainer(config: TrainConfig, model_dir: Path) -> Any:
    if config.trainer_backend == "verl":
        from lightning.algorithm.verl_backend import VerlTrainer

        return VerlTrainer(
            model_dir, config.update_config, checkpoints_dir(config), options=config.verl, run_name=config.run_name,
            rows_per_step=config.batch_size * config.samples_per_task, total_steps=config.iterations,
            ray_address=config.ray_address,
        )  # fmt: skip
    from lightning.algorithm.worker import TrainerWorker

    return TrainerWorker(
        model_dir, config.update_config, checkpoints_dir(config), threads=config.trainer_threads,
        start_timeout=config.timeouts.startup, stacks_dir=config.run_dir / "stacks", deterministic=config.deterministic,
    )  # fmt: skip


def _start_tracker(config: TrainConfig, tags: dict[str, str] | None = None) -> Any:
    """The run's MLflow run (found by the run's name in the experiment, or created): its tags (source commit, user,
    `tags`), the config as params and as `config.yaml`, system metrics if asked."""
    from lightning.metrics import MlflowTracker, run_tags

    tracker = MlflowTracker(
        tracking_uri=config.tracking_uri, experiment=config.experiment, run_name=config.run_name,
        tags=run_tags(tags), system_metrics=config.system_metrics,
    )  # fmt: skip
    tracker.run_id = tracker.find_run()  # a run whose name exists continues its MLflow run
    settings = config.model_dump(mode="json")
    tracker.start({"config": settings})
    tracker.log_config(settings)
    return tracker


def _log_history(tracker: Any, history: list[dict[str, Any]]) -> None:
    """Every iteration of the history logged: an iteration whose metrics did not reach MLflow before a crash is
    logged now."""
    logged = tracker.logged_steps("reward") if history else set()
    for row in history:
        if row["iteration"] not in logged:
            tracker.log_metrics(row, row["iteration"])
