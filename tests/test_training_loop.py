"""Two training iterations end to end on real parts, through the library's stages without Prefect: a SQLite store,
runners, the LLM proxy, the embedded inference server on the tiny model, the adapter, the torch GRPO trainer in its
process, checkpoints and MLflow. The flows wrap exactly these calls."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from lightning import reporting, stages
from lightning.checkpoint import latest_checkpoint
from lightning.config import load_config
from lightning.run import Run

pytestmark = pytest.mark.slow


async def test_two_iterations_update_the_policy_log_to_mlflow_and_reload_the_server(tmp_path: Path) -> None:
    config = load_config(
        {
            "agent": "examples.copy_task.agent:copy_agent",
            "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
            "run_name": "two-iterations", "iterations": 2, "batch_size": 8, "samples_per_task": 4, "n_runners": 1,
            "runner_concurrency": 32, "sampling": {"temperature": 1.0, "max_tokens": 4}, "max_prompt_length": 64,
            "max_response_length": 8, "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 32},
            "checkpoint": {"log_every": 1}, "store_url": f"sqlite:///{tmp_path}/store.db",
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip
    run = await Run.open(config)
    try:
        initial = load_file(run.model_dir / "model.safetensors")
        for iteration in range(2):
            ids, summary = await stages.collect_rollouts(run, iteration)
            assert summary["succeeded"] == len(ids) == 32 and summary["with_reward"] == 32
            # Re-running the stage (a retried flow run) enqueues nothing new.
            assert await stages.enqueue_rollouts(run, iteration, run.resources_id("train")) == ids
            batch = await stages.adapt_spans(run, iteration, ids)
            assert batch["rows"] == 32 and batch["adapter"]["calls_without_token_ids"] == 0
            metrics = await stages.ppo_step(run, iteration, batch["batch_path"])
            row = reporting.iteration_row(iteration, summary, batch, metrics, rollout_seconds=1.0)
            saved = await stages.checkpoint(run, iteration, row)
        async with httpx.AsyncClient() as http:
            version = f"{run.endpoints.inference_urls[0]}/admin/version"
            # The run's own servers take only its random per-run keys: no other local user reloads or generates.
            assert (await http.get(version)).status_code == 401
            assert (await http.post(f"{run.endpoints.proxy_url}/admin/pause")).status_code == 401
            loaded = (await http.get(version, headers=run.inference_headers)).json()
        run_id = run.tracker.run_id
    finally:
        await run.close()

    published = latest_checkpoint(config.run_dir / "checkpoints")
    assert saved["checkpoint"] == str(published) and saved["step"] == 2
    trained = load_file(published / "model.safetensors")
    assert any(not torch.equal(initial[name], trained[name]) for name in initial), "the weights did not change"
    # The server now generates with the second checkpoint's weights, loaded without a restart.
    assert (loaded["version"], loaded["path"]) == (2, str(published))

    client = MlflowClient(config.tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "pg_loss")] == [0, 1]
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [0, 1]
    assert client.get_run(run_id).data.params["config.algorithm.lr"] == "0.001"
    assert client.get_run(run_id).info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    assert artifacts == ["checkpoints/step-000001", "checkpoints/step-000002"]
