"""Weight sync with vLLM replicas, driven by the run's own stages: two `vllm` servers (the stand-in executable
tests/support/fake_vllm.py, real processes and real HTTP, since vLLM itself needs a GPU) behind the real LLM proxy,
colocated with the trainer (weight_sync: sleep). The PPO step pauses the proxy and puts both servers to sleep; the
checkpoint wakes them, reloads the new weights in place, and resumes the proxy under the new weight version."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import httpx
import pytest

from lightning import stages
from lightning.algorithm.batch import TrainingBatch
from lightning.config import load_config
from lightning.run import Run
from lightning.types import Triplet

pytestmark = pytest.mark.slow
FAKE_VLLM = Path(__file__).parent / "support" / "fake_vllm.py"


async def test_vllm_replicas_sleep_through_the_ppo_step_and_wake_on_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", "proxy-secret")  # as when the proxy is exposed to other machines
    auth = {"authorization": "Bearer proxy-secret"}
    executable = tmp_path / "vllm"
    executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    executable.chmod(executable.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.jsonl"
    config = load_config(
        {
            "run_name": "sync",
            "agent": "examples.copy_task.agent:copy_agent",
            "inference": {
                "backend": "vllm", "replicas": 2, "gpus_per_replica": 1, "weight_sync": "sleep",
                "vllm": {"executable": str(executable), "startup_timeout": 60, "request_timeout": 30,
                         "env": {"FAKE_VLLM_CALLS": str(calls)}},
            },
            "algorithm": {"lr": 1e-3, "micro_batch_size": 8},
            "store_url": f"sqlite:///{tmp_path}/store.db",
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
            "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip
    run = await Run.open(config)
    servers = list(run.vllm_servers)
    try:
        proxy = run.endpoints.proxy_url
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{proxy}/admin/status")).status_code == 401
            status = (await http.get(f"{proxy}/admin/status", headers=auth)).json()
            assert len(status["backends"]) == 2 and status["weight_version"] == 0 and not status["paused"]

            resources_id = await stages.update_resources(run, "train")
            resources = await run.store.get_resources_by_id(resources_id)
            # The store never holds the proxy's token: runners read it from $LIGHTNING_PROXY_TOKEN (set above).
            assert resources.resources["main_llm"].api_key is None

            triplets = [
                Triplet(prompt=[5, 6], response=[7, 8], reward=float(i % 2), metadata={"group_id": 0}) for i in range(4)
            ]
            batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=4, max_response_length=4)
            batch_path = batch.save(tmp_path / "batch")
            metrics = await stages.ppo_step(run, 0, str(batch_path))
            assert metrics["step"] == 1.0
            # No call reaches a sleeping server.
            assert (await http.get(f"{proxy}/admin/status", headers=auth)).json()["paused"]

            saved = await stages.checkpoint(run, 0, {"iteration": 0, "reward": 0.5})
            status = (await http.get(f"{proxy}/admin/status", headers=auth)).json()
            assert status["weight_version"] == 1 and not status["paused"]

        admin = [json.loads(line) for line in calls.read_text().splitlines()]
        admin = [c for c in admin if c.get("path") in ("/sleep", "/wake_up", "/collective_rpc")]
        assert [c["path"] for c in admin].count("/sleep") == 2
        assert [c["path"] for c in admin].count("/wake_up") == 2
        reloads = [c["body"] for c in admin if c["path"] == "/collective_rpc"]
        assert len(reloads) == 2 and all(saved["checkpoint"] in json.dumps(body) for body in reloads)
        # Both servers slept before either woke, and each reload came after a wake-up.
        paths = [c["path"] for c in admin]
        assert max(i for i, p in enumerate(paths) if p == "/sleep") < min(
            i for i, p in enumerate(paths) if p == "/wake_up"
        )
        assert paths.index("/wake_up") < paths.index("/collective_rpc")
        starts = [json.loads(line) for line in calls.read_text().splitlines() if '"event": "start"' in line]
        assert len(starts) == 2
    finally:
        await run.close()
    assert len(servers) == 2 and not any(server.is_running() for server in servers)  # closing the run stopped them
