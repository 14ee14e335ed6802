"""The stages of one training iteration as plain library calls: enqueue rollouts, run runners, wait,
adapt spans into a training batch, take a PPO/GRPO step, checkpoint and publish the new weights.

The Prefect flow wraps each stage in a task; tests, benchmarks and scripts call them directly.
`LocalStack` brings up the embedded pieces (inference server, LLM proxy) on background threads.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from lightning.agent import LitAgent
from lightning.runner import Runner
from lightning.store.base import LightningStore
from lightning.tracing import find_final_reward
from lightning.types import EnqueueRolloutRequest, ProxyLLM, Rollout, RolloutConfig, RolloutMode

logger = logging.getLogger(__name__)


def group_id(run_name: str, mode: str, iteration: int, task_index: int) -> str:
    """The samples of one task in one iteration form a group (group-relative advantages)."""
    return f"{run_name}/{mode}/{iteration}/{task_index}"


async def enqueue_rollouts(
    store: LightningStore,
    tasks: Sequence[Any],
    *,
    run_name: str,
    iteration: int,
    samples_per_task: int = 1,
    resources_id: str | None = None,
    mode: RolloutMode = "train",
    config: RolloutConfig | None = None,
) -> list[str]:
    """Enqueue `samples_per_task` rollouts of each task; returns their ids in task order. Idempotent:
    enqueuing the same (run, mode, iteration) again returns the rollouts enqueued the first time."""
    requests = []
    for task_index, task in enumerate(tasks):
        group = group_id(run_name, mode, iteration, task_index)
        for sample in range(samples_per_task):
            requests.append(
                EnqueueRolloutRequest(
                    input=task,
                    mode=mode,
                    resources_id=resources_id,
                    config=config,
                    metadata={
                        "run_name": run_name,
                        "iteration": iteration,
                        "task_index": task_index,
                        "group_id": group,
                    },
                    idempotency_key=f"{group}/{sample}",
                )
            )
    return [rollout.rollout_id for rollout in await store.enqueue_many_rollouts(requests)]


async def take_over_rollouts(store: LightningStore, rollout_ids: Sequence[str], resources_id: str) -> dict[str, int]:
    """Adopt rollouts an earlier process of this run left unfinished (it was killed mid-iteration): point queued
    ones at `resources_id` (the old proxy is gone), and requeue ones whose attempt was left running, marking that
    attempt `unresponsive`. Call it only when no runner of the run is alive. Returns what it changed."""
    repointed = requeued = 0
    for rollout_id in rollout_ids:
        rollout = await store.get_rollout_by_id(rollout_id)
        if rollout is None or rollout.status in ("succeeded", "failed", "cancelled"):
            continue
        if rollout.status in ("preparing", "running"):
            await store.update_attempt(rollout_id, "latest", status="unresponsive")
            await store.update_rollout(rollout_id, resources_id=resources_id, status="requeuing")
            requeued += 1
        elif rollout.resources_id != resources_id:
            await store.update_rollout(rollout_id, resources_id=resources_id)
            repointed += 1
    if requeued or repointed:
        logger.warning(
            "took over %d unfinished rollouts of an earlier process: %d requeued, %d repointed to resources %s",
            requeued + repointed, requeued, repointed, resources_id,
        )  # fmt: skip
    return {"requeued": requeued, "repointed": repointed}


async def run_runners(
    store: LightningStore,
    agent: LitAgent[Any],
    rollout_ids: Sequence[str],
    *,
    runners: int = 8,
    timeout: float = 600,
    worker_prefix: str = "runner",
) -> list[Rollout]:
    """Run `runners` runners in this event loop until every rollout in `rollout_ids` has finished
    (or `timeout` passes); returns the rollouts as the store has them then."""
    from lightning.tracing import Tracer

    stop = asyncio.Event()
    tracer = Tracer(store)  # one exporter for the fleet, not a thread per runner
    fleet = [
        Runner(agent, store, tracer=tracer, worker_id=f"{worker_prefix}-{i}", idle_wait=0.05) for i in range(runners)
    ]
    working = [asyncio.create_task(runner.iter(stop_event=stop)) for runner in fleet]
    try:
        finished = await store.wait_for_rollouts(rollout_ids=list(rollout_ids), timeout=timeout)
    finally:
        stop.set()
        await asyncio.gather(*working, return_exceptions=True)
        await asyncio.to_thread(tracer.shutdown)
    return finished


async def rollout_rewards(store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, float | None]:
    """Each rollout's final reward (None when it has none)."""
    rewards: dict[str, float | None] = {}
    for rollout_id in rollout_ids:
        rewards[rollout_id] = find_final_reward(await store.query_spans(rollout_id, "latest"))
    return rewards


async def summarize_rollouts(store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """Counts by status and the mean final reward of the rollouts that have one."""
    rollouts = [await store.get_rollout_by_id(rollout_id) for rollout_id in rollout_ids]
    statuses = [r.status if r is not None else "missing" for r in rollouts]
    rewards = [r for r in (await rollout_rewards(store, rollout_ids)).values() if r is not None]
    return {
        "rollouts": len(rollout_ids),
        "succeeded": statuses.count("succeeded"),
        "failed": len(statuses) - statuses.count("succeeded"),
        "with_reward": len(rewards),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
    }


async def adapt_spans(
    store: LightningStore,
    rollout_ids: Sequence[str],
    batch_path: Path,
    *,
    pad_token_id: int,
    max_prompt_length: int,
    max_response_length: int,
    shape: str = "transition",
    reward_match: str = "final",
) -> dict[str, Any]:
    """Spans of the rollouts -> triplets -> a TrainingBatch file at `batch_path`; returns the
    adapter's and the batch's reports (what was dropped, and by which rule)."""
    from lightning.adapter import adapt_rollouts
    from lightning.algorithm.batch import TrainingBatch

    adapted = await adapt_rollouts(store, list(rollout_ids), shape=shape, reward_match=reward_match)
    batch = TrainingBatch.from_triplets(
        adapted.triplets,
        pad_token_id=pad_token_id,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
    )
    batch_path.parent.mkdir(parents=True, exist_ok=True)
    batch.save(batch_path)
    return {"rows": len(batch), "adapter": adapted.report.model_dump(), "batch": batch.report()}


def ppo_step(trainer: Any, batch_path: Path) -> dict[str, float]:
    """One policy update on the batch file."""
    from lightning.algorithm.batch import TrainingBatch

    return trainer.step(TrainingBatch.load(batch_path))


def publish_weights(
    trainer: Any, checkpoint_root: Path, step: int, servers: Sequence[str] = (), *, keep_last: int = 3, meta: Any = None
) -> Path:
    """Checkpoint the policy (atomically) and have each embedded inference server load it; returns the
    model directory that transformers and vLLM load."""
    from lightning.checkpoint import save_checkpoint

    path = save_checkpoint(
        checkpoint_root,
        step,
        trainer.model,
        trainer.tokenizer,
        trainer_state=trainer.state_dict(),
        meta=meta,
        keep_last=keep_last,
    )
    model_dir = _model_dir(path)
    for server in servers:
        response = httpx.post(f"{server}/admin/reload", json={"path": str(model_dir), "version": step}, timeout=600)
        response.raise_for_status()
    return model_dir


def _model_dir(checkpoint: Path) -> Path:
    from lightning.checkpoint import load_checkpoint

    return load_checkpoint(checkpoint).model_dir


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


async def timed(coro: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started
