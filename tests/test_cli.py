"""The `lightning` command's documented forms, run as a user runs them: `debug stacks RUN`, `models build-tiny DIR`,
`mlflow promote NAME latest|best|N`, `mlflow ui`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning.cli import main
from lightning.models import build_tiny_model
from lightning.serving import free_port

LIGHTNING = str(Path(sys.executable).parent / "lightning")


def test_debug_stacks_prints_the_stacks_of_a_runs_live_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "runs" / "stuck"
    # A process of the run, registered as the run's processes register (lightning.diagnose), busy in a function.
    code = (
        "import sys, time\nfrom lightning.diagnose import dump_stacks_on_signal\n"
        "dump_stacks_on_signal(sys.argv[1], 'trainer')\n"
        "def waiting_for_the_batch():\n    print('ready', flush=True)\n    time.sleep(120)\n"
        "waiting_for_the_batch()\n"
    )
    busy = subprocess.Popen([sys.executable, "-c", code, str(run_dir / "stacks")], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "ready"
        # As the README says it (the run's name), from the installed command; then the run's directory.
        shown = subprocess.run(
            [LIGHTNING, "debug", "stacks", "stuck", "--output-dir", str(tmp_path / "runs")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert f"== trainer (pid {busy.pid})" in shown.stdout and "waiting_for_the_batch" in shown.stdout
        assert main(["debug", "stacks", str(run_dir)]) == 0
        assert "waiting_for_the_batch" in capsys.readouterr().out
    finally:
        busy.kill()
        busy.wait()
    with pytest.raises(SystemExit):
        main(["debug", "stacks", "nope", "--output-dir", str(tmp_path / "runs")])
    assert "no run 'nope'" in capsys.readouterr().err


def test_models_build_tiny_builds_the_model_a_run_builds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One default, the library's: the command's model is `model: tiny`'s, which vLLM's CPU build serves (heads of
    32; it refuses 16)."""
    assert main(["models", "build-tiny", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    library = build_tiny_model(tmp_path / "library")
    built = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert built == json.loads((library / "config.json").read_text())
    assert built["hidden_size"] // built["num_attention_heads"] == 32
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (library / "model.safetensors").read_bytes()


def test_mlflow_promote_latest_best_or_a_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow import MlflowClient

    from lightning.metrics import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, run_name="r")
    tracker.start()
    for step, reward in ((1, "0.9000"), (2, "0.6720")):  # the newer version is the worse one
        checkpoint = tmp_path / f"step-{step:06d}"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text("{}")
        tracker.register_model(checkpoint, "m", tags={"val_reward": reward})
    tracker.end()
    client = MlflowClient(uri, registry_uri=uri)

    assert main(["mlflow", "promote", "m", "latest", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert client.get_model_version_by_alias("m", "champion").version == 2
    assert "version 2 (held-out reward 0.6720)" in out and "note: version 1 has a higher held-out reward" in out
    assert main(["mlflow", "promote", "m", "best", "--tracking-uri", uri]) == 0
    assert client.get_model_version_by_alias("m", "champion").version == 1
    assert "note:" not in capsys.readouterr().out
    assert main(["mlflow", "promote", "m", "2", "--alias", "candidate", "--tracking-uri", uri]) == 0
    assert client.get_model_version_by_alias("m", "candidate").version == 2
    with pytest.raises(SystemExit):
        main(["mlflow", "promote", "absent", "latest", "--tracking-uri", uri])
    assert "no registered model 'absent'" in capsys.readouterr().err


@pytest.mark.slow
def test_mlflow_ui_serves_a_run_store_offline(tmp_path: Path) -> None:
    """`lightning mlflow ui --backend-store-uri URI` (what `make mlflow-ui` runs)."""
    port = free_port()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [LIGHTNING, "mlflow", "ui", "--backend-store-uri", uri, "--port", str(port)]
    ui = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert ui.poll() is None, ui.stdout.read().decode() if ui.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "MLflow's UI did not answer within 180 s"
            time.sleep(0.5)
        assert "<html" in httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text.lower()
    finally:
        import os
        import signal

        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(30)


def test_the_groups_list_their_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    """`lightning inference --help` and `lightning models` name what there is to run (they listed nothing)."""
    with pytest.raises(SystemExit):
        main(["inference", "--help"])
    assert "serve" in capsys.readouterr().out
    assert main(["models"]) == 2
    assert "build-tiny" in capsys.readouterr().out


def test_compare_logprobs_says_in_one_line_what_it_cannot_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown rollout id, a store server or a database that does not answer, a SQLite file that is not there:
    one error line each (the store is read before the model loads: this model directory would not load), exit 1,
    no traceback, and no empty store made where the file was not."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def refused(store: str, *more: str) -> str:
        assert main(["debug", "compare-logprobs", str(model), "--store", store, *more]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    store = f"sqlite:///{tmp_path}/store.db"
    (tmp_path / "store.db").touch()
    assert refused(store, "--rollout", "ro-nope") == "error: query_spans: no rollout 'ro-nope'"
    said = refused("http://127.0.0.1:1")
    assert said.startswith("error: query_rollouts: no answer from the store at http://127.0.0.1:1")
    said = refused("postgresql://postgres:secret@127.0.0.1:1/x", "--rollout", "ro-1")
    assert said.startswith("error: --store postgresql://postgres:***@127.0.0.1:1/x: cannot read the store: Operational")
    assert "secret" not in said
    missing = tmp_path / "nowhere" / "store.db"
    said = refused(f"sqlite:///{missing}")
    assert said == f"error: --store sqlite:///{missing}: no such file {missing}; give the run's store_url"
    assert not missing.parent.exists()
