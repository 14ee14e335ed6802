"""What a user finds in MLflow after training, against a real `mlflow server` (SQLite backend, artifacts served by
it): the run's rollouts as traces (LLM calls with their messages and tokens, rewards; tag filters), its tags (source
commit, user, the Prefect flow run), the config as `config.yaml`, system metrics, the experiment marked as model
training, the final model registered with its held-out reward and promoted by `lightning mlflow promote`, and the
link to the run that the flow publishes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from examples.copy_task.data import val_tasks
from flows.train import train
from lightning import cli
from lightning.config import load_config
from lightning.store import SqlLightningStore

pytestmark = pytest.mark.slow
MLFLOW = str(Path(sys.executable).parent / "mlflow")
STARTUP_SECONDS = 120


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on a free port of 127.0.0.1, on SQLite, serving its artifacts (its URL), started while
    Prefect's test server starts."""
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [MLFLOW, "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
               str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    log = (root / "server.log").open("w")
    # (as `lightning mlflow ui` runs it: no job runner, whose seven processes are for GenAI evaluation jobs)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with prefect_test_harness(server_startup_timeout=180):
            deadline = time.monotonic() + STARTUP_SECONDS
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
            yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


async def test_a_run_s_traces_tags_config_and_model_in_a_real_mlflow_server(
    tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(task) + "\n" for task in val_tasks()[:4]))
    config = load_config({
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "run_name": "traced", "iterations": 1, "batch_size": 4, "samples_per_task": 2, "n_runners": 1,
        "runner_concurrency": 8, "val_data": str(val), "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64},
        "checkpoint": {"log_every": 1, "register_model": "traced-model"},
        "mlflow_traces": {"train_per_iteration": 4, "evaluation": "all"},
        "store_url": f"sqlite:///{tmp_path}/store.db", "tracking_uri": mlflow_server,
        "output_dir": str(tmp_path / "runs"),
    })  # fmt: skip
    summary = await train(config)

    client = MlflowClient(mlflow_server, mlflow_server)
    run = client.get_run(summary["mlflow_run_id"])
    run_id, experiment_id = run.info.run_id, run.info.experiment_id
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    tags = run.data.tags
    assert len(tags["mlflow.source.git.commit"]) == 40 and tags["mlflow.user"]
    assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{tags['prefect.flow_run_id']}")
    # What the UI shows: the source (with the commit beside it), and the flow run as a link in the description.
    assert tags["mlflow.source.name"] == "flows.train" and tags["mlflow.source.type"] == "LOCAL"
    assert f"[{tags['prefect.flow_run_id']}]({tags['prefect.flow_run_url']})" in tags["mlflow.note.content"]
    assert any(key.startswith("system/") for key in run.data.metrics), sorted(run.data.metrics)
    saved = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text())
    assert saved["run_name"] == "traced" and saved["mlflow_traces"]["train_per_iteration"] == 4

    # Traces: 4 of the 8 training rollouts, and the 4 held-out rollouts of each of the 2 evaluations (steps 0, 1).
    traces = client.search_traces(locations=[experiment_id], run_id=run_id, max_results=100)
    assert (
        # A training trace is placed by its iteration, a held-out one by the checkpoint it evaluated.
        sorted((t.info.tags["mode"], t.info.tags.get("iteration") or t.info.tags["checkpoint"]) for t in traces)
        == [("train", "0")] * 4 + [("val", "0")] * 4 + [("val", "1")] * 4
    )
    train_traces = client.search_traces(
        locations=[experiment_id], run_id=run_id, filter_string="tags.mode = 'train' AND tags.iteration = '0'"
    )
    assert len(train_traces) == 4
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        for trace in train_traces:
            by_type = {span.span_type: span for span in trace.data.spans}
            llm, reward = by_type["CHAT_MODEL"], by_type["EVALUATOR"]
            assert llm.inputs["messages"][-1]["role"] == "user" and llm.outputs["choices"][0]["message"]["content"]
            assert llm.attributes["mlflow.chat.tokenUsage"]["output_tokens"] >= 1
            assert "lightning.llm.response_token_ids" not in llm.attributes  # the store keeps the tokens
            assert trace.info.tags["reward"] == str(reward.outputs["reward"])
            # ... and the trace's `reward` assessment, the Traces tab's score column
            [score] = [each for each in trace.info.assessments if each.name == "reward"]
            assert score.value == reward.outputs["reward"]
            # The store's span, with its original start.
            stored = await store.query_spans(trace.info.tags["rollout_id"], trace.info.tags["attempt_id"])
            [call] = [span for span in stored if "gen_ai.operation.name" in span.attributes]
            assert abs(llm.start_time_ns - call.start_time * 1e9) < 1e3
    reward = train_traces[0].info.tags["reward"]
    with_reward = client.search_traces(
        locations=[experiment_id], run_id=run_id, filter_string=f"tags.mode = 'train' AND tags.reward = '{reward}'"
    )
    assert {t.info.tags["reward"] for t in with_reward} == {reward}
    assert len(with_reward) == sum(t.info.tags["reward"] == reward for t in train_traces)

    # The final model, registered with its held-out reward, then promoted.
    assert summary["registered_model"] == {"name": "traced-model", "version": 1}
    version = client.get_model_version("traced-model", "1")
    assert version.run_id == run_id and version.tags["val_reward"] == f"{summary['reward_after']:.4f}"
    assert cli.main(["mlflow", "promote", "traced-model", "latest", "--tracking-uri", mlflow_server]) == 0
    assert client.get_model_version_by_alias("traced-model", "champion").version == "1"

    # The run's summary artifact links the run's page on the server.
    async with get_client() as prefect:
        artifacts = await prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["traced-summary"]))
        )
    assert f"{mlflow_server}/#/experiments/{experiment_id}/runs/{run_id}" in artifacts[0].data
    assert httpx.get(f"{mlflow_server}/", timeout=10).status_code == 200
