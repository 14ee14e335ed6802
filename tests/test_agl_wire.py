"""agent-lightning 0.3.0's own store client (its package, in its own Python 3.12 venv from `make agl-peer`)
against our store server: its REST routes under /v1/agl, its paginated answers, a token in the address, rollouts
that agl enqueues and waits for while our runner runs them, and agl's store semantics call by call (on SQLite and
PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AGL_ENV, serving
from prefect_server import free_port

from lightning.runner import Runner
from lightning.store import SqlLightningStore
from lightning.store.client import HttpLightningStore
from lightning.store.server import create_app

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "support" / "agl_client.py"
TOKEN = "agl-s3cret"


def agl(python: str, *args: str, timeout: float = 120) -> Any:
    done = subprocess.run(
        [python, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=SCRIPT.parent, env=AGL_ENV
    )
    assert done.returncode == 0, f"agl's client failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.agl
def test_agl_client_walks_the_store_lifecycle(agl_python: str, tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    with serving(create_app(store)) as url:
        seen = agl(agl_python, "walk", url)

    first, second, third = seen["enqueued"]
    assert seen["dequeued"] == first  # oldest first
    assert seen["span_stored"] is True
    assert seen["finished"] == [[first, "succeeded"]]
    assert seen["paginated"] is True
    assert seen["query_rollouts"] == {"type": "PaginatedResult", "ids": [first], "total": 1}
    assert seen["queued_page"] == {"items": 1, "limit": 1, "total": 2}  # total counts past the page
    assert seen["spans"] == ["agent.step", "agent.answer"]
    assert seen["spans_named"] == ["agent.answer"]
    ((attempt_id, status, worker),) = seen["attempts"]
    assert (status, worker) == ("succeeded", "agl-worker")
    assert seen["latest_attempt"] == attempt_id
    assert seen["get_rollout_by_id"] == {"type": "AttemptedRollout", "attempt_id": attempt_id}
    assert seen["unknown_rollout"] is None
    assert seen["statistics"] == {
        "total_rollouts": 3,
        "total_attempts": 1,
        "total_spans": 2,
        "total_resources": 1,
        "total_workers": 1,
    }
    assert seen["workers"] == ["agl-worker"]
    assert seen["latest_resources"] == seen["resources_id"]


@pytest.mark.agl
def test_agl_enqueues_our_runner_runs_agl_reads_the_rewards(agl_python: str, tmp_path: Path) -> None:
    from support.agents import counting_agent

    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    with serving(create_app(store, token=TOKEN)) as url:
        agl_url = f"{url}/t/{TOKEN}"  # agl's client cannot send a header: the token rides in the address
        ids = agl(agl_python, "enqueue", agl_url, "3")["ids"]

        def run_ours() -> None:
            import asyncio

            async def main() -> None:
                remote = HttpLightningStore(url, token=TOKEN)
                runner = Runner(counting_agent, remote, worker_id="ours", idle_wait=0.2)
                await runner.iter(max_rollouts=3)
                await runner.close()
                await remote.close()

            asyncio.run(main())

        thread = threading.Thread(target=run_ours)
        thread.start()
        collected = agl(agl_python, "collect", agl_url, *ids)
        thread.join(timeout=60)

    assert sorted(collected) == sorted(ids)
    for rollout in collected.values():
        assert rollout["status"] == "succeeded"
        assert rollout["reward"] == 1.0  # agl's find_final_reward reads the reward span our runner wrote


@pytest.mark.agl
def test_agl_runner_runs_our_rollouts_and_we_read_its_rewards(agl_python: str, tmp_path: Path) -> None:
    import asyncio

    from lightning.tracing.rewards import get_final_reward
    from lightning.types import PromptTemplate

    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)

    async def enqueue() -> list[str]:
        await store.add_resources({"prompt": PromptTemplate(template="Say {word}", engine="f-string")})
        rollouts = [await store.enqueue_rollout({"word": word}, mode="train") for word in ("one", "two")]
        return [r.rollout_id for r in rollouts]

    ids = asyncio.run(enqueue())
    with serving(create_app(store)) as url:
        agl(agl_python, "agl-runner", url, "2")

    async def results() -> list[tuple[str, float | None]]:
        return [((await store.get_rollout_by_id(i)).status, await get_final_reward(store, i)) for i in ids]

    assert asyncio.run(results()) == [("succeeded", 1.0), ("succeeded", 1.0)]


@pytest.mark.agl
def test_a_token_server_refuses_agl_without_the_token_in_the_address(agl_python: str, tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    with serving(create_app(store, token=TOKEN)) as url:
        assert httpx.get(f"{url}/v1/agl/statistics").status_code == 401
        assert httpx.get(f"{url}/t/wrong/v1/agl/statistics").status_code == 401
        assert httpx.get(f"{url}/t/{TOKEN}/v1/agl/statistics").status_code == 200
        done = subprocess.run(
            [agl_python, str(SCRIPT), "enqueue", f"{url}/t/wrong", "1"],
            capture_output=True,
            text=True,
            timeout=120,  # as agl()'s: agent-lightning's import alone took 60 s with the suite's workers beside it
            env=AGL_ENV,
        )
    assert done.returncode != 0 and "401" in done.stderr


@pytest.mark.agl
def test_agl_store_semantics_hold_over_the_agl_routes(agl_python: str, shared_url: str) -> None:
    store = SqlLightningStore(shared_url, watchdog_interval=None)
    try:
        with serving(create_app(store)) as url:
            seen = agl(agl_python, "semantics", url)
    finally:
        asyncio.run(store.close())

    # An explicit null is a 400 where agl's server refuses it; a field that may be cleared takes it.
    assert seen["null"] == {
        "update_worker.heartbeat_stats": 400,
        "update_attempt.worker_id": 400,
        "update_attempt.last_heartbeat_time": 400,
        "update_attempt.metadata": 400,
        "update_rollout.status": 400,
        "update_rollout.config": 400,
        "update_rollout.mode": "ok",
    }
    assert seen["next_span"] == [1, 2, 3]  # the rollout's counter, whatever the attempt id ("latest", unknown)
    assert seen["worker_moved"] == ["busy", True]
    assert seen["resources_id_kept"] == ["rs-later", "rs-later"]
    assert seen["resources_id_length"] == len("rs-") + 12
    assert seen["null_first"] and seen["null_last"]  # on PostgreSQL too
    assert (seen["bad_sort_by"], seen["bad_limit"], seen["missing_field"]) == (400, 400, 422)


@pytest.mark.agl
def test_store_serve_watchdog_interval_marks_a_silent_attempt_unresponsive(
    agl_python: str, shared_url: str, tmp_path: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "lightning.cli", "store", "serve", "--port", str(port), "--db", shared_url]
    command += ["--watchdog-interval", "0.1", "--log-level", "warning"]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/v1/agl/health", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
        seen = agl(agl_python, "unresponsive", url)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert seen == {"status": "unresponsive"}


def test_agl_routes_answer_bad_requests_with_4xx(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    with serving(create_app(store)) as url:
        base = f"{url}/v1/agl"
        wrong_field = httpx.post(f"{base}/rollouts/search", json={"statuses": ["queuing"]})
        assert wrong_field.status_code == 422 and "statuses" in wrong_field.json()["detail"]
        wrong_sort = httpx.get(f"{base}/rollouts", params={"sort_by": "input"}).json()["detail"]
        assert wrong_sort.startswith("Invalid sort_by: input, allowed fields are: rollout_id, start_time")
        null = httpx.post(f"{base}/workers/w1", json={"heartbeat_stats": None})
        assert null.status_code == 400 and "heartbeat_stats" in null.json()["detail"]
        assert httpx.post(f"{base}/rollouts/search", content=b"{not json").status_code == 400
        unknown = httpx.post(f"{base}/rollouts/ro-missing/attempts/at-missing", json={"status": "running"})
        assert unknown.status_code == 404 and "ro-missing" in unknown.json()["detail"]
        assert httpx.get(f"{base}/rollouts/ro-missing").json() is None
        page = httpx.get(f"{base}/rollouts", params=[("status_in", "queuing"), ("status_in", "running")]).json()
        assert page == {"items": [], "limit": -1, "offset": 0, "total": 0}
