"""Weight sync with vLLM replicas, driven by the run's own stages: two `vllm` servers (the stand-in executable
tests/support/fake_vllm.py, real processes and real HTTP, since vLLM itself needs a GPU) behind the real LLM proxy,
colocated with the trainer (weight_sync: sleep). The PPO step pauses the proxy and puts both servers to sleep; the
checkpoint wakes them, reloads the new weights in place, and resumes the proxy under the new weight version.

With `algorithm.lora` the replicas get each checkpoint's adapter alone, through vLLM's adapter API, and the proxy
sends the policy's calls to it (real vLLM serving such an adapter: tests/test_vllm_cpu.py)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import httpx
import pytest

from lightning import semconv, stages
from lightning.algorithm.batch import TrainingBatch
from lightning.config import load_config
from lightning.run import Run
from lightning.types import Triplet

pytestmark = pytest.mark.slow
FAKE_VLLM = Path(__file__).parent / "support" / "fake_vllm.py"


def fake_vllm(tmp_path: Path) -> Path:
    executable = tmp_path / "vllm"
    executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    executable.chmod(executable.stat().st_mode | stat.S_IXUSR)
    return executable


def a_batch(tmp_path: Path, name: str) -> str:
    triplets = [
        Triplet(prompt=[5, 6], response=[7, 8], reward=float(i % 2), metadata={"group_id": 0}) for i in range(4)
    ]
    batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    return str(batch.save(tmp_path / name))


async def test_vllm_replicas_sleep_through_the_ppo_step_and_wake_on_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", "proxy-secret")  # as when the proxy is exposed to other machines
    auth = {"authorization": "Bearer proxy-secret"}
    executable = fake_vllm(tmp_path)
    calls = tmp_path / "calls.jsonl"
    config = load_config(
        {
            "run_name": "sync",
            "agent": "examples.copy_task.agent:copy_agent",
            "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
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

            metrics = await stages.ppo_step(run, 0, a_batch(tmp_path, "batch"))
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


async def test_a_lora_run_publishes_each_adapter_to_its_vllm_replicas_and_the_proxy_routes_and_records_it(
    tmp_path: Path,
) -> None:
    """Each checkpoint of a LoRA run reaches both replicas as its adapter (`load_lora_adapter` under a name of its own,
    no whole-weights reload; colocated replicas woken first), the proxy sends the policy's calls to that name and
    records it with the step on their spans, and the adapter before is unloaded. A run opened again starts its
    replicas on the base model with LoRA on and loads the latest adapter before any call."""
    calls = tmp_path / "calls.jsonl"
    config = load_config(
        {
            "run_name": "lora-sync", "agent": "examples.copy_task.agent:copy_agent",
            "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
            "inference": {
                "backend": "vllm", "replicas": 2, "weight_sync": "sleep",
                "vllm": {"executable": str(fake_vllm(tmp_path)), "startup_timeout": 60, "request_timeout": 30,
                         "env": {"FAKE_VLLM_CALLS": str(calls)}},
            },
            "algorithm": {"lr": 1e-3, "micro_batch_size": 8, "lora": {"rank": 4, "alpha": 8}},
            "store_url": f"sqlite:///{tmp_path}/store.db", "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip

    def recorded(path: str) -> list[dict]:
        return [c for c in map(json.loads, calls.read_text().splitlines()) if c.get("path") == path]

    async def call_the_policy(run: Run) -> tuple[str, dict]:
        """One chat call of an attempt through the run's proxy: the model the replica got, the span's attributes."""
        rollout = await run.store.start_rollout({"task": 0})
        route = f"/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1/chat/completions"
        body = {"model": "policy", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 1}
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {run.proxy_token}"}) as http:
            answer = await http.post(f"{run.endpoints.proxy_url}{route}", json=body)
        assert answer.status_code == 200, answer.text
        [span] = await run.store.query_spans(rollout.rollout_id)
        return answer.json()["model"], span.attributes

    run = await Run.open(config, track=False)
    try:
        model_dir = str(run.model_dir)
        starts = [json.loads(line) for line in calls.read_text().splitlines() if '"event": "start"' in line]
        assert len(starts) == 2
        for start in starts:  # the base model, LoRA on, room for rank 4
            assert start["argv"][1] == model_dir and start["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
            assert " ".join(start["argv"]).count("--enable-lora --max-lora-rank 8 --max-loras 1") == 1
        model, attributes = await call_the_policy(run)  # the base model, step 0
        assert model == "policy" and attributes[semconv.LLM_WEIGHT_VERSION] == 0
        assert semconv.LLM_LORA_ADAPTER not in attributes

        await stages.ppo_step(run, 0, a_batch(tmp_path, "batch-0"))
        first = (await stages.checkpoint(run, 0, {"iteration": 0, "reward": 0.5}))["checkpoint"]
        model, attributes = await call_the_policy(run)
        assert model == "policy-lora-1"
        assert (attributes[semconv.LLM_WEIGHT_VERSION], attributes[semconv.LLM_LORA_ADAPTER]) == (1, "policy-lora-1")
        assert attributes[semconv.GEN_AI_RESPONSE_MODEL] == "policy-lora-1"

        await stages.ppo_step(run, 1, a_batch(tmp_path, "batch-1"))
        second = (await stages.checkpoint(run, 1, {"iteration": 1, "reward": 0.5}))["checkpoint"]
        model, attributes = await call_the_policy(run)
        assert model == "policy-lora-2"
        assert (attributes[semconv.LLM_WEIGHT_VERSION], attributes[semconv.LLM_LORA_ADAPTER]) == (2, "policy-lora-2")
    finally:
        await run.close()
    loads = [(c["body"]["lora_name"], c["body"]["lora_path"]) for c in recorded("/v1/load_lora_adapter")]
    assert loads == [("policy-lora-1", first)] * 2 + [("policy-lora-2", second)] * 2
    assert [c["body"]["lora_name"] for c in recorded("/v1/unload_lora_adapter")] == ["policy-lora-1"] * 2
    assert recorded("/collective_rpc") == []  # never whole weights
    admin = [c["path"] for c in map(json.loads, calls.read_text().splitlines()) if c.get("method") == "POST"]
    # Each update: both replicas asleep through the PPO step, both woken, then the new adapter, then the old one gone.
    update = ["/sleep", "/sleep", "/wake_up", "/wake_up", "/v1/load_lora_adapter", "/v1/load_lora_adapter"]
    unload = ["/v1/unload_lora_adapter"] * 2
    assert [path for path in admin if path != "/v1/chat/completions"] == [*update, *update, *unload]

    calls.unlink()
    run = await Run.open(config, train=False, track=False)  # resumes: the replicas start on the base, then step 2
    try:
        assert [c["body"]["lora_path"] for c in recorded("/v1/load_lora_adapter")] == [second] * 2
        [start, _] = [json.loads(line) for line in calls.read_text().splitlines() if '"event": "start"' in line]
        assert start["argv"][1] == model_dir
        model, attributes = await call_the_policy(run)
        assert (model, attributes[semconv.LLM_WEIGHT_VERSION]) == ("policy-lora-2", 2)
    finally:
        await run.close()
