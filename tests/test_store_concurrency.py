"""Many workers claiming rollouts at once: every rollout handed out exactly once, none lost."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lightning.types import EnqueueRolloutRequest

REPO_ROOT = Path(__file__).resolve().parent.parent

WORKER_SCRIPT = """
import asyncio, json, sys

from lightning.store import SqlLightningStore


async def main(url: str, worker_id: str) -> None:
    store = SqlLightningStore(url, watchdog_interval=None)
    try:
        print("ready", flush=True)
        sys.stdin.readline()  # wait for "go", so that every process starts claiming at once
        claimed = []
        while True:
            got = await store.dequeue_rollout(worker_id=worker_id)
            if got is None:
                break
            claimed.append(got.rollout_id)
            await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
        print(json.dumps(claimed), flush=True)
    finally:
        await store.close()


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_asyncio_workers_claim_each_rollout_once(store: Any) -> None:
    n_rollouts, n_workers = 300, 16
    enqueued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n_rollouts)])
    claims: list[str] = []

    async def worker(worker_id: str) -> None:
        while True:
            got = await store.dequeue_rollout(worker_id=worker_id)
            if got is None:
                return
            claims.append(got.rollout_id)
            await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")

    await asyncio.wait_for(asyncio.gather(*(worker(f"w{i}") for i in range(n_workers))), timeout=60)

    counts = Counter(claims)
    assert [rid for rid, c in counts.items() if c > 1] == []
    assert set(counts) == {r.rollout_id for r in enqueued}
    succeeded = await store.query_rollouts(status_in=["succeeded"])
    assert len(succeeded) == n_rollouts
    for rid in [enqueued[0].rollout_id, enqueued[-1].rollout_id]:
        assert [a.sequence_id for a in await store.query_attempts(rid)] == [1]


async def test_asyncio_dequeue_many_claims_each_rollout_once(store: Any) -> None:
    n_rollouts = 120
    enqueued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n_rollouts)])

    async def worker(worker_id: str) -> list[str]:
        mine: list[str] = []
        while batch := await store.dequeue_many_rollouts(limit=7, worker_id=worker_id):
            mine.extend(r.rollout_id for r in batch)
        return mine

    results = await asyncio.wait_for(asyncio.gather(*(worker(f"w{i}") for i in range(8))), timeout=60)
    claims = [rid for mine in results for rid in mine]
    assert len(claims) == len(set(claims)) == n_rollouts
    assert set(claims) == {r.rollout_id for r in enqueued}


async def test_processes_claim_each_rollout_once(shared_url: str, open_store: Any, tmp_path: Path) -> None:
    n_rollouts, n_procs = 400, 4
    store = open_store(shared_url)
    enqueued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n_rollouts)])
    script = tmp_path / "claim_worker.py"
    script.write_text(WORKER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}

    procs = [
        subprocess.Popen(
            [sys.executable, str(script), shared_url, f"proc-{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i in range(n_procs)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip() != "ready":
                _, err = p.communicate(timeout=30)
                pytest.fail(f"worker process did not start: {line!r}\n{err}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = await asyncio.gather(*(asyncio.to_thread(p.communicate, timeout=120) for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    claims: list[str] = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"worker process failed:\n{err}"
        claims.extend(json.loads(out.strip().splitlines()[-1]))

    counts = Counter(claims)
    assert [rid for rid, c in counts.items() if c > 1] == [], "rollouts claimed twice"
    assert set(counts) == {r.rollout_id for r in enqueued}, "rollouts lost"
    assert len(await store.query_rollouts(status_in=["succeeded"])) == n_rollouts
