"""A training run's stages as functions of its `TrainConfig`: what the Prefect tasks in `tasks/` wrap, one
call each, and what `benchmarks/flow_overhead.py` calls directly.

Stages pass ids, paths and small JSON between them; everything else lives in the store and in the run
directory (`config.run_dir`: the model, checkpoints, batches, `run.json`). Each stage is idempotent: the
store's idempotency keys make a second enqueue return the first one's rollouts, a checkpoint step is saved
atomically, and a run whose name exists resumes after its last checkpoint.

The long-lived parts a run needs (the store, the inference server, the LLM proxy, the trainer process, the
MLflow run) are brought up once per process by `start_run` and found again by each stage with `services`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from lightning import training
from lightning.config import TrainConfig, load_agent, load_tasks
from lightning.store.base import LightningStore
from lightning.types import ProxyLLM

logger = logging.getLogger(__name__)

FAULTS_ENV = "LIGHTNING_FAULTS"
"""Injected faults for tests and drills: `stage@iteration[,stage@iteration...]`, e.g. `ppo_step@1`. Each fires
once per run (a marker file in the run directory remembers it), so a retry of the failed run goes through."""


class InjectedFault(RuntimeError):
    """Raised by a stage named in LIGHTNING_FAULTS."""


class Endpoints(BaseModel):
    """Where a run's serving parts answer; small enough to pass between Prefect tasks."""

    proxy_url: str
    """The LLM proxy, without /v1."""
    model_name: str
    inference_urls: list[str] = []
    """Servers that load each new checkpoint (embedded servers' base URLs)."""


@dataclass
class RunServices:
    """What `start_run` brought up in this process for one run."""

    config: TrainConfig
    store: LightningStore
    endpoints: Endpoints
    model_dir: Path
    """The initial policy (the trainer's KL reference)."""
    trainer: Any = None
    tracker: Any = None
    tokenizer: Any = None
    stack: Any = None
    vllm: list[Any] = field(default_factory=list)
    """The vLLM servers this run started (inference.backend vllm), one per replica."""
    closers: list[Any] = field(default_factory=list)


_services: dict[str, RunServices] = {}
_lock = threading.RLock()


# --- the run: paths, resume point, bring-up and shutdown ------------------------------------------------


def checkpoints_dir(config: TrainConfig) -> Path:
    return config.run_dir / "checkpoints"


def completed_iterations(config: TrainConfig) -> int:
    """Iterations whose checkpoint is on disk: a run resumes at this iteration (checkpoint step = iteration + 1)."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint

    latest = latest_checkpoint(checkpoints_dir(config))
    return 0 if latest is None else load_checkpoint(latest).step


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
    from lightning.models import build_tiny_model

    path = config.run_dir / "model"
    if not (path / "config.json").is_file():
        build_tiny_model(path, seed=config.seed)
    return path


def start_run(config: TrainConfig, *, train: bool = True, weights: str | None = None) -> Endpoints:
    """Bring up what the run needs in this process (once; later calls return the same endpoints): the store, the
    inference server on the latest weights, the LLM proxy and, with `train`, the trainer process and the MLflow
    run. `weights`: a checkpoint to serve instead of the latest one."""
    with _lock:
        if config.run_name in _services:
            return _services[config.run_name].endpoints
        config.run_dir.mkdir(parents=True, exist_ok=True)
        model_dir = prepare_model(config)
        from lightning.checkpoint import latest_checkpoint

        latest = latest_checkpoint(checkpoints_dir(config))
        serving_dir = Path(weights) if weights else model_dir if latest is None else latest
        store = open_run_store(config)
        run = RunServices(
            config, store, Endpoints(proxy_url="", model_name=config.inference.served_model_name), model_dir
        )
        try:
            if train:  # the trainer process loads torch and the model while the servers come up
                _start_trainer(run)
                trainer_ready = concurrent.futures.ThreadPoolExecutor(1).submit(run.trainer.start)
            _start_serving(run, serving_dir)
            if train:
                _start_tracker(run)
                trainer_ready.result(timeout=config.timeouts.startup)
        except BaseException:
            _close(run)
            raise
        _services[config.run_name] = run
        serving_step = serve_checkpoint_step(config, weights)
        if not config.proxy_endpoint:  # every span from now on records the weights that produced it
            _proxy_admin(run, "resume", {"weight_version": serving_step})
        proxy_port = int(run.endpoints.proxy_url.rsplit(":", 1)[1]) if not config.proxy_endpoint else 0
        _write_state(config, {"endpoints": run.endpoints.model_dump(), "proxy_port": proxy_port, "pid": os.getpid()})
        return run.endpoints


def serve_checkpoint_step(config: TrainConfig, checkpoint: str | None) -> int:
    """The step of `checkpoint` (default: the run's latest; 0 when it has none, the initial model)."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint

    path = Path(checkpoint) if checkpoint else latest_checkpoint(checkpoints_dir(config))
    return 0 if path is None else load_checkpoint(path).step


def services(config: TrainConfig) -> RunServices:
    """This process's services for the run; brought up now if a stage runs before `start_run` (a retried run)."""
    if config.run_name not in _services:
        start_run(config)
    return _services[config.run_name]


async def stop_run(config: TrainConfig, status: str = "FINISHED") -> None:
    """Shut down what `start_run` brought up; `status` ends the MLflow run (FINISHED, FAILED, KILLED)."""
    with _lock:
        run = _services.pop(config.run_name, None)
        store = _stores.pop(config.store_url, None)
    if run is not None:
        if run.tracker is not None:
            await asyncio.to_thread(run.tracker.end, status)
        await asyncio.to_thread(_close, run)
    if store is not None:
        await store.close()


def _start_serving(run: RunServices, serving_dir: Path) -> None:
    config, inference = run.config, run.config.inference
    name = inference.served_model_name
    if config.proxy_endpoint:
        run.endpoints = Endpoints(proxy_url=config.proxy_endpoint.rstrip("/"), model_name=name)
        return
    # The proxy keeps its port across restarts of the run, so the resources in the store stay valid.
    port = read_state(config).get("proxy_port", 0)
    port = port if port and _port_free(port) else 0
    if inference.backend == "embedded" and inference.endpoint is None:
        run.stack = training.LocalStack(
            run.store, serving_dir, model_name=name, max_batch_size=inference.max_batch_size,
            server="thread" if inference.in_process else "process",
            proxy="thread" if config.proxy_in_process or _in_memory(config.store_url) else "process",
            store_url=config.store_url, proxy_port=port,
        )  # fmt: skip
        run.closers.append(run.stack.close)
        inference_urls = [run.stack.inference_url]
        run.endpoints = Endpoints(proxy_url=run.stack.proxy_url, model_name=name, inference_urls=inference_urls)
        return
    backends = [inference.endpoint]
    if inference.backend == "vllm" and inference.endpoint is None:
        run.vllm = _start_vllm(config, serving_dir)
        backends = [server.endpoint for server in run.vllm]
    from lightning.proxy import LLMProxy

    proxy = LLMProxy(run.store, [str(backend) for backend in backends], model_name=name, token=proxy_token())
    run.endpoints = Endpoints(proxy_url=proxy.start(host=config.proxy_host, port=port), model_name=name)
    run.closers.append(proxy.stop)


def _start_vllm(config: TrainConfig, serving_dir: Path) -> list[Any]:
    """`inference.replicas` vLLM servers on the policy, started together and waited for; replica i gets its own
    GPUs when `gpus_per_replica` is set. Each is stopped with the run."""
    from lightning.inference.vllm import VllmConfig, VllmServer
    from lightning.serving import free_port

    inference = config.inference
    servers = []
    for replica in range(inference.replicas):
        options = dict(inference.vllm)
        if inference.gpus_per_replica:
            first = replica * inference.gpus_per_replica
            devices = ",".join(str(first + i) for i in range(inference.gpus_per_replica))
            options["env"] = {**options.get("env", {}), "CUDA_VISIBLE_DEVICES": devices}
        if inference.weight_sync == "sleep":
            options["enable_sleep_mode"] = True
        vllm_config = VllmConfig(
            model=str(serving_dir), served_model_name=inference.served_model_name, port=free_port(), **options
        )
        server = VllmServer(vllm_config, log_path=config.run_dir / f"vllm-{replica}.log")
        server.start()
        servers.append(server)
    for server in servers:
        server.wait_ready()
    return servers


def proxy_token() -> str | None:
    """The bearer token of the run's own LLM proxy ($LIGHTNING_PROXY_TOKEN), needed when it listens beyond loopback."""
    return os.environ.get("LIGHTNING_PROXY_TOKEN") or None


def _proxy_admin(run: RunServices, action: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    """POST /admin/<action> to the run's own LLM proxy: `pause` holds new calls and waits for the ones in flight,
    `resume` lets calls through and records `weight_version` on every span from then on."""
    token = proxy_token()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    url = f"{run.endpoints.proxy_url}/admin/{action}"
    response = httpx.post(url, json=body or {}, headers=headers, timeout=timeout + 5)
    response.raise_for_status()
    return response.json()


def _in_memory(store_url: str) -> bool:
    """An in-memory SQLite store exists only in this process: a proxy process could not reach it."""
    return store_url in ("sqlite://", "sqlite:///:memory:")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        # As uvicorn binds: the old proxy's closed connections linger in TIME_WAIT for a minute after a restart.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_trainer(run: RunServices) -> None:
    config = run.config
    if config.trainer_backend == "verl":
        from lightning.algorithm.verl_backend import VerlTrainer

        run.trainer = VerlTrainer(
            run.model_dir, config.algorithm, checkpoints_dir(config), options=config.verl, run_name=config.run_name,
            rows_per_step=config.batch_size * config.samples_per_task, total_steps=config.iterations,
            ray_address=config.ray_address,
        )  # fmt: skip
    else:
        from lightning.algorithm.worker import TrainerWorker

        run.trainer = TrainerWorker(
            run.model_dir, config.algorithm, checkpoints_dir(config), threads=config.trainer_threads
        )
    run.closers.append(run.trainer.close)


def _start_tracker(run: RunServices) -> None:
    from lightning.metrics import MlflowTracker

    config = run.config
    state = read_state(config)
    tracker = MlflowTracker(
        tracking_uri=config.tracking_uri, experiment=config.experiment, run_name=config.run_name,
        run_id=state.get("mlflow_run_id"),
    )  # fmt: skip
    tracker.start(None if state.get("mlflow_run_id") else {"config": config.model_dump(mode="json")})
    run.tracker = tracker
    _write_state(config, {"mlflow_run_id": tracker.run_id})


def _close(run: RunServices) -> None:
    for close in reversed(run.closers):
        try:
            close()
        except Exception:
            logger.exception("shutting down %s failed", close)
    run.closers.clear()


def read_state(config: TrainConfig) -> dict[str, Any]:
    path = config.run_dir / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_state(config: TrainConfig, changes: dict[str, Any]) -> None:
    path = config.run_dir / "run.json"
    state = {**read_state(config), **changes}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


_stores: dict[str, LightningStore] = {}


def open_run_store(config: TrainConfig) -> LightningStore:
    """One store object per URL in this process (SqlLightningStore is safe across threads and event loops)."""
    from lightning.store import open_store

    with _lock:
        if config.store_url not in _stores or getattr(_stores[config.store_url], "_closed", False):
            if config.store_url.startswith("sqlite:///"):
                Path(config.store_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            _stores[config.store_url] = open_store(config.store_url)
        return _stores[config.store_url]


def maybe_fail(config: TrainConfig, stage: str, iteration: int) -> None:
    """Raise InjectedFault once if LIGHTNING_FAULTS names `stage@iteration`."""
    wanted = {item.strip() for item in os.environ.get(FAULTS_ENV, "").split(",") if item.strip()}
    name = f"{stage}@{iteration}"
    if name not in wanted:
        return
    marker = config.run_dir / "faults" / name
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{time.time()}\n")
    raise InjectedFault(f"injected fault {name} ({FAULTS_ENV}); it fires once per run, so a retry goes through")


# --- the stages ---------------------------------------------------------------------------------------


def select_tasks(config: TrainConfig, iteration: int) -> list[Any]:
    """The iteration's `batch_size` training tasks: epochs over the shuffled dataset, reproducible by seed, so a
    resumed or retried iteration asks for the same tasks (and the store returns the same rollouts)."""
    tasks = _dataset(config.train_data, "train_data")
    start = iteration * config.batch_size
    chosen = []
    for position in range(start, start + config.batch_size):
        epoch, index = divmod(position, len(tasks))
        order = list(range(len(tasks)))
        random.Random(f"{config.seed}/{epoch}").shuffle(order)
        chosen.append(tasks[order[index]])
    return chosen


_datasets: dict[tuple[str, str], list[Any]] = {}


def _dataset(spec: str, field_name: str) -> list[Any]:
    key = (spec, field_name)
    if key not in _datasets:
        _datasets[key] = load_tasks(spec, field_name)
    return _datasets[key]


async def update_resources(config: TrainConfig, iteration: int, proxy_url: str, *, evaluation: bool = False) -> str:
    """Publish the iteration's LLM resource (the proxy at `proxy_url`, with sampling parameters); its id."""
    sampling = config.eval_sampling if evaluation else config.sampling
    model = config.inference.served_model_name
    token = None if config.proxy_endpoint or config.inference.backend == "embedded" else proxy_token()
    llm = ProxyLLM(endpoint=f"{proxy_url}/v1", model=model, sampling_parameters=sampling, api_key=token)
    resources = await open_run_store(config).add_resources({"llm": llm})
    return resources.resources_id


async def enqueue_rollouts(config: TrainConfig, iteration: int, resources_id: str, *, mode: str = "train") -> list[str]:
    """Enqueue the iteration's rollouts (or find the ones enqueued before); their ids.

    A rollout left unfinished by an earlier process of this run (killed mid-iteration) is taken over: pointed at
    this process's resources, and requeued if an attempt was left running with nobody to finish it.
    """
    store = open_run_store(config)
    tasks = select_tasks(config, iteration) if mode == "train" else _dataset(str(config.val_data), "val_data")
    samples = config.samples_per_task if mode == "train" else 1
    ids = await training.enqueue_rollouts(
        store, tasks, run_name=config.run_name, iteration=iteration, samples_per_task=samples,
        resources_id=resources_id, mode=mode, config=config.rollout,
    )  # fmt: skip
    await training.take_over_rollouts(store, ids, resources_id)
    return ids


async def run_runner(config: TrainConfig, rollout_ids: list[str], index: int = 0) -> dict[str, Any]:
    """One runner task: `runner_concurrency` runners claim rollouts until all of `rollout_ids` finish."""
    store = open_run_store(config)
    started = time.perf_counter()
    finished = await training.run_runners(
        store, load_agent(config.agent), rollout_ids, runners=config.runner_concurrency,
        timeout=config.timeouts.rollouts, worker_prefix=f"{config.run_name}-runner{index}",
    )  # fmt: skip
    return {"runner": index, "finished": len(finished), "seconds": time.perf_counter() - started}


async def wait_for_rollouts(config: TrainConfig, rollout_ids: list[str]) -> dict[str, Any]:
    """Wait until the rollouts finish (at most `timeouts.rollouts`); their counts and mean reward."""
    store = open_run_store(config)
    await store.wait_for_rollouts(rollout_ids=rollout_ids, timeout=config.timeouts.rollouts)
    return await training.summarize_rollouts(store, rollout_ids)


async def adapt_spans(config: TrainConfig, iteration: int, rollout_ids: list[str]) -> dict[str, Any]:
    """The rollouts' spans as a training batch file; its path, rows and what the adapter dropped."""
    run = services(config)
    path = config.run_dir / "batches" / f"iteration-{iteration:06d}"
    report = await training.adapt_spans(
        run.store, rollout_ids, path, pad_token_id=_tokenizer(run).pad_token_id,
        max_prompt_length=config.max_prompt_length, max_response_length=config.max_response_length,
        shape=config.adapter_shape,
    )  # fmt: skip
    return {"batch_path": str(path), **report}


async def ppo_step(config: TrainConfig, iteration: int, batch_path: str) -> dict[str, float]:
    """One policy update in the trainer process (or verl's workers), stopped if it passes `timeouts.ppo_step`.
    Colocated vLLM (weight_sync: sleep) releases its GPU memory first; `checkpoint` wakes it on the new weights."""
    maybe_fail(config, "ppo_step", iteration)
    run = services(config)
    if run.vllm and config.inference.weight_sync == "sleep":
        await asyncio.to_thread(_proxy_admin, run, "pause", None, config.timeouts.checkpoint)
        for server in run.vllm:
            await asyncio.to_thread(server.sleep, 1)
    return await asyncio.to_thread(run.trainer.step, batch_path, timeout=config.timeouts.ppo_step)


async def checkpoint(config: TrainConfig, iteration: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Save checkpoint `iteration + 1`, have the inference servers load it, log the iteration to MLflow."""
    run = services(config)
    step = iteration + 1
    path = await _publish(config, run, step, {"run_name": config.run_name, "iteration": iteration})
    last = step == config.iterations
    if config.checkpoint.log_to_mlflow and (step % config.checkpoint.log_every == 0 or last):
        await asyncio.to_thread(run.tracker.log_checkpoint, path, step)
    await asyncio.to_thread(run.tracker.log_metrics, metrics, iteration)
    return {"checkpoint": str(path), "step": step}


async def warm_start(config: TrainConfig) -> dict[str, Any]:
    """SFT on demonstrations of the first `warm_start.fraction` of the training tasks, then checkpoint step 0 (what
    iteration 0 samples from) and have the inference servers load it."""
    assert config.warm_start is not None
    from lightning.algorithm.batch import TrainingBatch
    from lightning.config import load_entry_point

    run = services(config)
    tasks = _dataset(config.train_data, "train_data")
    shown = tasks[: max(1, int(len(tasks) * config.warm_start.fraction))]
    demonstrate = load_entry_point(config.warm_start.demonstrations, "warm_start.demonstrations")
    batch = TrainingBatch.from_triplets(
        demonstrate(_tokenizer(run), shown), pad_token_id=_tokenizer(run).pad_token_id,
        max_prompt_length=config.max_prompt_length, max_response_length=config.max_response_length,
    )  # fmt: skip
    path = config.run_dir / "batches" / "warm-start"
    batch.save(path)
    metrics: dict[str, Any] = {}
    for _ in range(config.warm_start.steps):
        metrics = await asyncio.to_thread(run.trainer.sft_step, path, timeout=config.timeouts.ppo_step)
    saved = await _publish(config, run, 0, {"run_name": config.run_name, "warm_start": True})
    await asyncio.to_thread(run.tracker.log_metrics, {"warm_start": metrics}, 0)
    return {"demonstrations": len(batch), "steps": config.warm_start.steps, **metrics, "checkpoint": saved}


def _tokenizer(run: RunServices) -> Any:
    """The policy's tokenizer, loaded once per run in this process."""
    if run.tokenizer is None:
        from transformers import AutoTokenizer

        run.tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    return run.tokenizer


async def _publish(config: TrainConfig, run: RunServices, step: int, meta: dict[str, Any]) -> str:
    """Save checkpoint `step` in the trainer and put it into every inference server, with the proxy paused and
    drained around the swap so no rollout mixes two weight versions; spans from then on record version `step`."""
    path = await asyncio.to_thread(
        run.trainer.save_checkpoint, step, meta=meta, keep_last=config.checkpoint.keep_last,
        timeout=config.timeouts.checkpoint,
    )  # fmt: skip
    own_proxy = not config.proxy_endpoint
    if own_proxy:
        await asyncio.to_thread(_proxy_admin, run, "pause", None, config.timeouts.checkpoint)
    async with httpx.AsyncClient(timeout=config.timeouts.checkpoint) as client:
        for server in run.endpoints.inference_urls:
            response = await client.post(f"{server}/admin/reload", json={"path": str(path), "version": step})
            response.raise_for_status()
    for server in run.vllm:
        if config.inference.weight_sync == "sleep" and await asyncio.to_thread(server.is_sleeping):
            await asyncio.to_thread(server.wake_up)
        await asyncio.to_thread(server.reload_weights, path, str(step))
    if own_proxy:
        await asyncio.to_thread(_proxy_admin, run, "resume", {"weight_version": step})
    return path


async def evaluate(config: TrainConfig, step: int) -> dict[str, Any]:
    """Greedy rollouts of every validation task on the weights of checkpoint `step` (0: the initial model, after
    the warm start if there is one; -1: before the warm start), run here by `runner_concurrency` runners; counts
    and mean reward, logged to MLflow as val.* (val_initial.* for -1)."""
    if config.val_data is None:
        return {"rollouts": 0, "reward_mean": float("nan")}
    run = services(config)
    resources_id = await update_resources(config, step, run.endpoints.proxy_url, evaluation=True)
    ids = await enqueue_rollouts(config, step, resources_id, mode="val")
    await training.run_runners(
        run.store, load_agent(config.agent), ids, runners=config.runner_concurrency, timeout=config.timeouts.evaluate,
        worker_prefix=f"{config.run_name}-eval",
    )  # fmt: skip
    summary = await training.summarize_rollouts(run.store, ids)
    if run.tracker is not None:
        await asyncio.to_thread(run.tracker.log_metrics, {"val" if step >= 0 else "val_initial": summary}, max(step, 0))
    return {"step": step, **summary}


# --- reporting: the iteration table, progress, the run's summary ----------------------------------------


def iteration_row(
    iteration: int, rollouts: dict[str, Any], batch: dict[str, Any], metrics: dict[str, Any], rollout_seconds: float
) -> dict[str, Any]:
    """One line of the run's table (and of MLflow's metrics): reward, loss, KL, rollouts, throughput. Metrics the
    algorithm does not compute (KL without a KL term) are left out."""
    response_tokens = metrics.get("response_length_mean", 0.0) * batch["rows"]
    row = {
        "iteration": iteration,
        "reward": rollouts["reward_mean"],
        "rollouts_ok": rollouts["succeeded"],
        "rollouts_failed": rollouts["failed"],
        "rows": batch["rows"],
        "rollout_seconds": rollout_seconds,
        "rollout_tokens_per_s": response_tokens / rollout_seconds if rollout_seconds > 0 else 0.0,
        "train_tokens_per_s": metrics.get("tokens_per_s", 0.0),
        "pg_loss": metrics.get("pg_loss"),
        "kl": metrics.get("kl", metrics.get("kl_loss")),
        "entropy": metrics.get("entropy"),
        "grad_norm": metrics.get("grad_norm"),
        "step_time_s": metrics.get("step_time_s"),
    }
    return {name: value for name, value in row.items() if value is not None}


def record_iteration(config: TrainConfig, history: list[dict[str, Any]]) -> None:
    _write_state(config, {"history": history})


def record_state(config: TrainConfig, **changes: Any) -> None:
    """Remember facts of the run in run.json (what a resumed run must not redo)."""
    _write_state(config, changes)


def record_evaluation(config: TrainConfig, step: int, result: dict[str, Any]) -> None:
    evaluations = {**read_state(config).get("evaluations", {}), str(step): result}
    _write_state(config, {"evaluations": evaluations})


def progress_line(config: TrainConfig, row: dict[str, Any], done: int, elapsed: float) -> str:
    """`iteration 3/40 | reward 0.412 | loss ... | 9.8 s/it | ETA 6m02s`: this process's rate, the rest's ETA."""
    rate = elapsed / max(done, 1)
    left = config.iterations - row["iteration"] - 1
    val = f" | val {row['val_reward']:.3f}" if "val_reward" in row else ""
    kl = f" | kl {row['kl']:.4f}" if "kl" in row else ""
    return (
        f"iteration {row['iteration'] + 1}/{config.iterations} | reward {row['reward']:.3f}{val} | "
        f"pg_loss {row.get('pg_loss', float('nan')):.4f}{kl} | rollouts {row['rollouts_ok']} ok, "
        f"{row['rollouts_failed']} failed | {row['rollout_tokens_per_s']:.0f} tok/s | {rate:.1f} s/it | "
        f"ETA {_duration(rate * left)}"
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def mlflow_link(config: TrainConfig) -> str:
    """Where to look in MLflow: the run's URL on a tracking server, or the command that opens the local UI."""
    run_id = read_state(config).get("mlflow_run_id")
    if config.tracking_uri.startswith(("http://", "https://")):
        return f"[MLflow run]({config.tracking_uri.rstrip('/')}/#/experiments/runs/{run_id})"
    return f"MLflow run `{run_id}`: `mlflow ui --backend-store-uri {config.tracking_uri}`"


def finish_run(
    config: TrainConfig, before: dict[str, Any], after: dict[str, Any], initial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Register the final model if asked; the run's summary (also written to run.json)."""
    from lightning.checkpoint import latest_checkpoint

    run = services(config)
    final = latest_checkpoint(checkpoints_dir(config))
    if config.checkpoint.register_model and final is not None:
        run.tracker.register_model(final, config.checkpoint.register_model)
    summary = {
        "run_name": config.run_name,
        "iterations": config.iterations,
        "reward_initial": (initial or before)["reward_mean"],
        "reward_before": before["reward_mean"],
        "reward_after": after["reward_mean"],
        "checkpoint": str(final) if final else None,
        "mlflow_run_id": run.tracker.run_id,
        "tracking_uri": config.tracking_uri,
    }
    _write_state(config, {"summary": summary})
    return summary
