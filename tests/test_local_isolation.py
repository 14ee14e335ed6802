"""What other users and processes of the machine can reach: the store's SQLite files and a local MLflow database are
their owner's alone (they hold the run's prompts, spans and traces)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from lightning.store.sql import SqlLightningStore


async def test_the_store_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/runs/store.db", watchdog_interval=None)
    try:
        await store.enqueue_rollout({"x": 1})
        modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "runs").iterdir()}
    finally:
        await store.close()
    assert "store.db" in modes
    assert modes == dict.fromkeys(modes, 0o600), modes


async def test_an_existing_store_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    path.touch(mode=0o640)
    path.chmod(0o640)
    store = SqlLightningStore(f"sqlite:///{path}", watchdog_interval=None)
    await store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.slow  # MLflow's import and its schema migrations: 6 to 16 s on 2 busy cores
def test_a_new_local_mlflow_database_is_readable_by_its_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It holds the run's params, metrics and traces (prompts and answers), as the store holds its spans: made from
    the cached empty copy, or by MLflow itself where there is no cache to use."""
    from mlflow.tracking import MlflowClient

    from lightning.metrics import new_local_db

    copied = tmp_path / "copied" / "mlflow.db"
    copied.parent.mkdir()
    new_local_db(copied)
    (tmp_path / "not-a-directory").touch()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))  # no cache: MLflow builds it
    built = tmp_path / "built" / "mlflow.db"
    built.parent.mkdir()
    new_local_db(built)
    assert MlflowClient(tracking_uri=f"sqlite:///{built}").search_experiments()  # MLflow made its tables there
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in (copied, built)}
    assert modes == dict.fromkeys(modes, 0o600), modes
