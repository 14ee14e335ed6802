"""Two training iterations end to end on real parts: a SQLite store, runners, the LLM proxy, the
embedded inference server on the tiny model, the adapter, the torch GRPO trainer, checkpoints and
MLflow. The stages are the library calls the Prefect flow wraps."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from examples.copy_task.agent import copy_agent, make_tasks
from lightning import training
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig
from lightning.checkpoint import latest_checkpoint
from lightning.metrics import MlflowTracker
from lightning.models import build_tiny_model
from lightning.store import SqlLightningStore

pytestmark = pytest.mark.slow


async def test_two_iterations_update_the_policy_log_to_mlflow_and_reload_the_server(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    config = TrainerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=32, seed=0)
    trainer = TorchTrainer(model_dir, config)
    initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = MlflowTracker(tracking_uri=tracking_uri, experiment="test", run_name="two-iterations")
    run_id = tracker.start({"trainer": config.model_dump(), "samples_per_task": 4})
    tasks = make_tasks(8, seed=1)
    checkpoints = tmp_path / "checkpoints"

    with training.LocalStack(store, model_dir) as stack:
        sampling = {"temperature": 1.0, "max_tokens": 4}
        llm = stack.resource().model_copy(update={"sampling_parameters": sampling})
        resources = await store.add_resources({"llm": llm})
        for iteration in range(2):
            ids = await training.enqueue_rollouts(
                store, tasks, run_name="t", iteration=iteration, samples_per_task=4, resources_id=resources.resources_id
            )
            # Re-running the stage (a retried flow run) enqueues nothing new.
            assert (
                await training.enqueue_rollouts(
                    store,
                    tasks,
                    run_name="t",
                    iteration=iteration,
                    samples_per_task=4,
                    resources_id=resources.resources_id,
                )
                == ids
            )
            await training.run_runners(store, copy_agent, ids, runners=len(ids))
            summary = await training.summarize_rollouts(store, ids)
            assert summary["succeeded"] == len(ids) == 32 and summary["with_reward"] == 32
            batch_path = tmp_path / "batches" / f"iteration-{iteration}"
            adapted = await training.adapt_spans(
                store, ids, batch_path, pad_token_id=trainer.tokenizer.pad_token_id, max_prompt_length=64,
                max_response_length=8,
            )  # fmt: skip
            assert adapted["rows"] == 32 and adapted["adapter"]["calls_without_token_ids"] == 0
            metrics = training.ppo_step(trainer, batch_path)
            published = training.publish_weights(trainer, checkpoints, iteration + 1, [stack.inference_url])
            tracker.log_metrics({**metrics, "reward_mean": summary["reward_mean"]}, step=iteration)
            tracker.log_checkpoint(published, step=iteration + 1)
        loaded = httpx.get(f"{stack.inference_url}/admin/version").json()
        served = {name: value.clone() for name, value in stack.inference_app.state.engine.model.state_dict().items()}
    tracker.end()
    await store.close()

    trained = trainer.model.state_dict()
    assert any(not torch.equal(initial[name], trained[name]) for name in initial), "the weights did not change"
    # The server now generates with the second checkpoint's weights, loaded without a restart.
    assert loaded == {"version": 2, "path": str(published)}
    assert all(torch.equal(served[name], trained[name].to(served[name].dtype)) for name in served)
    assert latest_checkpoint(checkpoints) == published
    reloaded = AutoModelForCausalLM.from_pretrained(published)
    assert all(torch.equal(p, trained[n]) for n, p in reloaded.state_dict().items())

    client = MlflowClient(tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "pg_loss")] == [0, 1]
    assert len(client.get_metric_history(run_id, "reward_mean")) == 2
    assert client.get_run(run_id).data.params["trainer.lr"] == "0.001"
    artifacts = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    assert artifacts == ["checkpoints/step-000001", "checkpoints/step-000002"]
