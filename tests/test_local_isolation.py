"""What other users and processes of the machine can reach: the store's SQLite files are its owner's alone (they
hold the run's prompts, spans and resources, the proxy's token among them)."""

from __future__ import annotations

import stat
from pathlib import Path

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
