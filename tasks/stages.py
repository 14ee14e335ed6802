"""The stages of a training iteration as Prefect tasks. Each body is one `lightning.pipeline` call; what Prefect
adds is declared on the decorator:

- retries with backoff on the stages that can fail transiently (the store or the inference server restarting);
  none on `ppo_step`, whose failures are not transient (a retried flow run re-runs it);
- a timeout on every stage, the outer bound: the library enforces the config's own deadlines inside (the
  trainer process is killed at `timeouts.ppo_step`; Prefect's timeout cannot stop blocking code);
- results persisted as JSON under a (train run, run name, iteration, stage) cache key, so retrying a failed
  flow run skips the stages that finished;
- `ppo_step` is tagged `gpu`: `prefect concurrency-limit create gpu 1` (done by `deployments/setup.py`) allows
  one update per GPU at a time.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning import pipeline
from lightning.config import TrainConfig
from lightning.pipeline import Endpoints
from tasks.caching import stage_cache_key

HOUR = 3600
STAGE = {"persist_result": True, "result_serializer": "json", "cache_key_fn": stage_cache_key}
TRANSIENT = {"retries": 2, "retry_delay_seconds": [2, 10], "retry_jitter_factor": 0.5}


@task(name="start_run", cache_policy=NO_CACHE, timeout_seconds=HOUR, retries=1, retry_delay_seconds=5)
def start_run(config: TrainConfig, train: bool = True, weights: str | None = None) -> Endpoints:
    """Bring up the store, inference server, LLM proxy, trainer and MLflow run in this process (never cached:
    a retried flow run is a new process and needs its own)."""
    return pipeline.start_run(config, train=train, weights=weights)


@task(name="update_resources", task_run_name="update_resources-{iteration}", timeout_seconds=600, **STAGE, **TRANSIENT)
async def update_resources(config: TrainConfig, iteration: int, proxy_url: str) -> str:
    return await pipeline.update_resources(config, iteration, proxy_url)


@task(name="enqueue_rollouts", task_run_name="enqueue_rollouts-{iteration}", timeout_seconds=600, **STAGE, **TRANSIENT)
async def enqueue_rollouts(config: TrainConfig, iteration: int, resources_id: str) -> list[str]:
    return await pipeline.enqueue_rollouts(config, iteration, resources_id)


@task(name="run_runner", task_run_name="run_runner-{iteration}-{index}", timeout_seconds=6 * HOUR, **STAGE, **TRANSIENT)
async def run_runner(config: TrainConfig, iteration: int, rollout_ids: list[str], index: int) -> dict[str, Any]:
    """One runner task, on a thread of the flow's process or a Ray worker; its result says where it ran."""
    import os
    import socket

    done = await pipeline.run_runner(config, rollout_ids, index)
    return {**done, "host": socket.gethostname(), "pid": os.getpid()}


@task(
    name="wait_for_rollouts",
    task_run_name="wait_for_rollouts-{iteration}",
    timeout_seconds=6 * HOUR,
    **STAGE,
    **TRANSIENT,
)
async def wait_for_rollouts(config: TrainConfig, iteration: int, rollout_ids: list[str]) -> dict[str, Any]:
    return await pipeline.wait_for_rollouts(config, rollout_ids)


@task(name="adapt_spans", task_run_name="adapt_spans-{iteration}", timeout_seconds=HOUR, **STAGE, **TRANSIENT)
async def adapt_spans(config: TrainConfig, iteration: int, rollout_ids: list[str]) -> dict[str, Any]:
    return await pipeline.adapt_spans(config, iteration, rollout_ids)


@task(name="ppo_step", task_run_name="ppo_step-{iteration}", tags=["gpu"], timeout_seconds=6 * HOUR, **STAGE)
async def ppo_step(config: TrainConfig, iteration: int, batch_path: str) -> dict[str, float]:
    return await pipeline.ppo_step(config, iteration, batch_path)


@task(name="checkpoint", task_run_name="checkpoint-{iteration}", timeout_seconds=HOUR, **STAGE, **TRANSIENT)
async def checkpoint(config: TrainConfig, iteration: int, metrics: dict[str, Any]) -> dict[str, Any]:
    return await pipeline.checkpoint(config, iteration, metrics)


@task(name="warm_start", timeout_seconds=6 * HOUR, **STAGE)
async def warm_start(config: TrainConfig) -> dict[str, Any]:
    return await pipeline.warm_start(config)


@task(name="evaluate", task_run_name="evaluate-{step}", timeout_seconds=6 * HOUR, **STAGE, **TRANSIENT)
async def evaluate(config: TrainConfig, step: int) -> dict[str, Any]:
    return await pipeline.evaluate(config, step)
