"""MLflow tracking against a real local store: params, metrics per step, checkpoint artifacts, registered models,
resumed runs, and secrets that never reach the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.checkpoint import save_checkpoint
from lightning.metrics import MlflowTracker, loggable_params
from lightning.models import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module: creating its tables takes about two seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri, tracking_uri)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two checkpoints of the tiny model, with trainer state."""
    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    root = tmp_path_factory.mktemp("checkpoints")
    return [save_checkpoint(root, step, model, tokenizer, trainer_state={"step": step}) for step in (1, 2)]


CONFIG = {
    "model": {"path": "Qwen/Qwen2.5-0.5B", "lr": 1e-6, "max_tokens": 512, "pad_token_id": 0},
    "algorithm": {"name": "grpo", "clip": [0.2, 0.28], "use_kl": True},
    "openai": {"api_key": "sk-live-123", "base_url": "https://api.openai.com/v1"},
    "hf_token": "hf_secret_abc",
    "store": {"url": "postgresql://trainer:hunter2@db:5432/runs", "password": "hunter2"},
    "prompt": "x" * 7000,
}


def test_params_are_flattened_and_secrets_never_logged(tracking_uri: str, client) -> None:
    tracker = MlflowTracker(tracking_uri, experiment="params", run_name="grpo-tiny")
    run_id = tracker.start(CONFIG)
    tracker.end()

    params = client.get_run(run_id).data.params
    assert params["model.path"] == "Qwen/Qwen2.5-0.5B"
    assert params["model.lr"] == "1e-06"
    assert params["model.max_tokens"] == "512"
    assert params["model.pad_token_id"] == "0"
    assert params["algorithm.clip"] == "[0.2, 0.28]"
    assert params["algorithm.use_kl"] == "true"
    assert params["openai.base_url"] == "https://api.openai.com/v1"
    assert params["store.url"] == "postgresql://trainer:***@db:5432/runs"
    assert len(params["prompt"]) == 6000 and params["prompt"].endswith("...")
    assert not {"openai.api_key", "hf_token", "store.password"} & params.keys()
    logged = " ".join([*params, *params.values()])
    for secret in ("sk-live-123", "hf_secret_abc", "hunter2"):
        assert secret not in logged
    assert client.get_run(run_id).info.run_name == "grpo-tiny"
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.parametrize("key", ["api_key", "OPENAI_API_KEY", "token", "access_token", "db_password", "client_secret"])
def test_secret_keys_are_dropped(key: str) -> None:
    assert loggable_params({"llm": {key: "x"}, "kept": 1}) == {"kept": "1"}


def test_metrics_per_step_read_back(tracking_uri: str, client) -> None:
    tracker = MlflowTracker(tracking_uri, experiment="metrics")
    run_id = tracker.start()
    for step in range(3):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "reward": {"mean": torch.tensor(0.25 * step)}}, step=step)
    tracker.log_metrics({"loss": float("nan")}, step=3)
    tracker.log_metrics({"mismatch_mean": 3e-7, "mismatch_max": 0.0}, step=3)  # a chart of 3e-7 reads "0" all along
    with pytest.raises(TypeError, match="'note' is not a number"):
        tracker.log_metrics({"note": "hello"}, step=4)
    tracker.end()

    loss = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in sorted(loss, key=lambda m: m.step)] == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    reward = client.get_metric_history(run_id, "reward.mean")
    assert [(m.step, m.value) for m in sorted(reward, key=lambda m: m.step)] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    [log10] = client.get_metric_history(run_id, "mismatch_mean_log10")
    assert log10.step == 3 and abs(log10.value - -6.5229) < 1e-3
    assert client.get_metric_history(run_id, "mismatch_max_log10") == []  # no log of 0


def test_checkpoints_logged_and_registered(
    tracking_uri: str, client, checkpoints: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker = MlflowTracker(tracking_uri, experiment="checkpoints")
    run_id = tracker.start()
    assert tracker.log_checkpoint(checkpoints[0], step=1) == "checkpoints/step-000001"

    names = {Path(f.path).name for f in client.list_artifacts(run_id, "checkpoints/step-000001")}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meta.json"} <= names
    assert "trainer_state" not in names

    assert tracker.register_model(checkpoints[0], "tiny-policy") == 1
    # Not logged yet: register_model uploads it first.
    assert tracker.register_model(checkpoints[1], "tiny-policy") == 2
    assert [Path(f.path).name for f in client.list_artifacts(run_id, "checkpoints")] == ["step-000001", "step-000002"]
    version = client.get_model_version("tiny-policy", "2")
    assert version.run_id == run_id
    assert version.source == f"runs:/{run_id}/checkpoints/step-000002"
    assert version.tags["step"] == "2"
    tracker.end()

    import mlflow.artifacts

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    local = mlflow.artifacts.download_artifacts("models:/tiny-policy/2", dst_path=str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(local)
    original = AutoModelForCausalLM.from_pretrained(checkpoints[1])
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[name]), name


def test_resume_appends_to_the_same_run(tracking_uri: str, client) -> None:
    first = MlflowTracker(tracking_uri, experiment="resume", run_name="crashy")
    run_id = first.start({"lr": 0.1})
    first.log_metrics({"loss": 3.0}, step=0)
    first.log_metrics({"loss": 2.0}, step=1)
    first.end("failed")
    assert client.get_run(run_id).info.status == "FAILED"

    # A restarted training job, from the run id it stored: same params, one changed (MLflow keeps the first).
    second = MlflowTracker(tracking_uri, experiment="resume", run_id=run_id)
    assert second.start({"lr": 0.2, "resumed_from_step": 1}) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    second.log_metrics({"loss": 1.0}, step=2)
    second.end()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "resumed_from_step": "1"}
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    experiment = client.get_experiment_by_name("resume")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]

    third = MlflowTracker(tracking_uri)
    third.resume(run_id)
    third.log_metrics({"loss": 0.5}, step=3)
    assert len(client.get_metric_history(run_id, "loss")) == 4


def test_default_store_is_local_sqlite_under_dot_lightning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    tracker = MlflowTracker()
    db = tmp_path / ".lightning" / "mlflow.db"
    assert tracker.tracking_uri == f"sqlite:///{db}"
    tracker.experiment_id, tracker.run_id = "7", "abc"
    assert tracker.run_url == "http://127.0.0.1:5000/#/experiments/7/runs/abc"  # where `make mlflow-ui` serves it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert MlflowTracker().tracking_uri == "http://mlflow.internal:5000"


def test_local_store_keeps_artifacts_beside_its_database(tracking_uri: str, client) -> None:
    tracker = MlflowTracker(tracking_uri, experiment="artifacts")
    run_id = tracker.start()
    tracker.end()
    artifacts = Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts"
    assert client.get_run(run_id).info.artifact_uri.startswith(artifacts.as_uri() + "/")


def test_run_url_on_a_server() -> None:
    tracker = MlflowTracker("http://mlflow.internal:5000/")
    tracker.experiment_id, tracker.run_id = "7", "abc"
    assert tracker.run_url == "http://mlflow.internal:5000/#/experiments/7/runs/abc"
    tracker.tracking_uri = "http://trainer:hunter2@mlflow.internal:5000"  # a link is printed: no password in it
    assert tracker.run_url == "http://trainer:***@mlflow.internal:5000/#/experiments/7/runs/abc"


def test_importing_lightning_does_not_import_mlflow() -> None:
    code = "import sys, lightning, lightning.metrics; assert 'mlflow' not in sys.modules, 'mlflow imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_mlflow_link_names_the_run_s_page_or_the_offline_ui_command(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning.config import load_config
    from lightning.reporting import mlflow_link
    from lightning.run import Endpoints, Run, _Parts

    def link(tracking_uri: str) -> str:
        run = Run(config=load_config({"run_name": "r", "tracking_uri": tracking_uri}),
                  endpoints=Endpoints(proxy_url="", model_name="policy"), queue="r")  # fmt: skip
        tracker = MlflowTracker(tracking_uri, experiment="lightning")
        tracker.experiment_id, tracker.run_id = "7", "abc"
        run._parts = _Parts(store=SimpleNamespace(), model_dir=tmp_path, tracker=tracker)  # type: ignore[arg-type]
        return mlflow_link(run)

    # MLflow 3's UI routes a run's page under its experiment (a server's run page is checked in test_mlflow_server).
    assert link("http://mlflow:5000") == "[MLflow run r](http://mlflow:5000/#/experiments/7/runs/abc)"
    assert link("sqlite:///x.db") == (
        "[MLflow run r](http://127.0.0.1:5000/#/experiments/7/runs/abc) (served by "
        "`.venv/bin/lightning mlflow ui --backend-store-uri sqlite:///x.db`)"
    )
    assert link("sqlite:///.lightning/mlflow.db").endswith("(served by `make mlflow-ui`)")


def test_a_run_shows_its_source_commit_and_its_prefect_flow_run_as_a_link(tracking_uri: str, client) -> None:
    """MLflow's UI shows `mlflow.source.name` as the Source (the commit beside it) and renders the description
    (`mlflow.note.content`) as Markdown; a tag is plain text."""
    from lightning.metrics import run_tags

    url = "http://127.0.0.1:4200/runs/flow-run/1234"
    tags = run_tags({"prefect.flow_run_id": "1234", "prefect.flow_run_url": url, "mlflow.source.name": "flows.train"})
    tracker = MlflowTracker(tracking_uri, experiment="sourced", tags=tags)
    run = client.get_run(tracker.start())
    tracker.end()
    shown = run.data.tags
    assert shown["mlflow.source.name"] == "flows.train" and shown["mlflow.source.type"] == "LOCAL"
    assert shown["mlflow.source.git.commit"] == subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    assert "@" not in shown.get("mlflow.source.git.repoURL", "")
    assert f"Trained by Prefect flow run [1234]({url})" in shown["mlflow.note.content"]
    assert "`make prefect-ui`" in shown["mlflow.note.content"]


def test_a_new_local_store_is_copied_from_a_cached_empty_one_and_works_as_mlflow_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow builds a database with its schema migrations (2 s a new run directory); a tracker copies an empty one
    of this MLflow version from the user's cache instead, built there once by MLflow."""
    import sqlite3

    import mlflow

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    trackers = []
    for name in ("first", "second"):  # the first builds the cache's copy, the second only copies it
        tracker = MlflowTracker(experiment="lab", run_name=name, tracking_uri=f"sqlite:///{tmp_path / name}/m.db")
        tracker.start({"lr": 0.1})
        tracker.log_metrics({"reward": 0.5}, step=0)
        tracker.end()
        trackers.append(tracker)
    assert (tmp_path / "cache" / "lightning" / f"mlflow-{mlflow.__version__}.db").is_file()
    assert [path.name for path in (tmp_path / "second").iterdir()] == ["m.db"]  # no scratch file left
    reference = tmp_path / "mlflow-built.db"
    mlflow.MlflowClient(f"sqlite:///{reference}").search_experiments()
    for tracker, name in zip(trackers, ("first", "second"), strict=True):
        history = tracker.client.get_metric_history(tracker.run_id, "reward")
        assert [(m.step, m.value) for m in history] == [(0, 0.5)]
        with sqlite3.connect(tmp_path / name / "m.db") as db:
            schema = db.execute("SELECT version_num FROM alembic_version").fetchall()
            default = db.execute("SELECT artifact_location FROM experiments WHERE experiment_id = 0").fetchone()
        with sqlite3.connect(reference) as db:
            assert schema == db.execute("SELECT version_num FROM alembic_version").fetchall()
        assert default == (str(tmp_path / name / "mlartifacts" / "0"),)


def test_a_damaged_cached_copy_leaves_mlflow_to_build_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    template = tmp_path / "cache" / "lightning" / f"mlflow-{mlflow.__version__}.db"
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database")
    tracker = MlflowTracker(experiment="lab", run_name="r", tracking_uri=f"sqlite:///{tmp_path / 'run'}/m.db")
    tracker.start({})
    tracker.log_metrics({"reward": 1.0}, step=0)
    tracker.end()
    assert [m.value for m in tracker.client.get_metric_history(tracker.run_id, "reward")] == [1.0]
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["m.db"]
