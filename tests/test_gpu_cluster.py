"""The cluster path on a GPU machine: the real `train` flow with vLLM serving rollouts (colocated, sleeping through
each PPO step) and verl's FSDP workers on Ray doing the update, against the same flow on the torch trainer.

Never runs in CI (no GPU there): `pytest -m gpu tests/test_gpu_cluster.py -s`. The model is a Llama built locally
(LIGHTNING_GPU_MODEL may name a local Hugging Face model directory instead). It prints, per backend, the rollout
(generation) tokens/s, the PPO step's tokens/s and seconds, and the peak GPU memory in use.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def gpu_memory_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return sum(int(line) for line in out.stdout.split())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    pytest.importorskip("verl")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("LIGHTNING_GPU_MODEL"):
        return Path(os.environ["LIGHTNING_GPU_MODEL"])
    from lightning.models import build_tiny_model

    # head_dim 64 (what vLLM's attention kernels take), a few million parameters.
    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "llama", hidden_size=512, num_layers=4, num_heads=8, vocab_size=384
    )


def run_train(tmp_path: Path, model_dir: Path, backend: str) -> dict[str, Any]:
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import train
    from lightning.config import load_config
    from lightning.run import recorded_history

    config = load_config(
        {
            "run_name": f"gpu-{backend}",
            "agent": "examples.copy_task.agent:copy_agent",
            "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
            "model": str(model_dir),
            "iterations": 3,
            "batch_size": 32,
            "samples_per_task": 4,
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "max_response_length": 8,
            "inference": {"backend": "vllm", "weight_sync": "sleep",
                          "vllm": {"gpu_memory_utilization": 0.3, "extra_args": ["--enforce-eager"],
                                   "executable": shutil.which("vllm") or str(Path(sys.executable).parent / "vllm")}},
            "trainer_backend": backend,
            "algorithm": {"lr": 1e-5, "micro_batch_size": 16},
            "store_url": f"sqlite:///{tmp_path}/store.db",
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
            "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip
    with prefect_test_harness(server_startup_timeout=300):
        summary = asyncio.run(train(config))
    return {"summary": summary, "history": recorded_history(config), "gpu_memory_mib": gpu_memory_used_mib()}


@pytest.mark.parametrize("backend", ["torch", "verl"])
def test_train_flow_on_vllm_with_each_trainer(tmp_path: Path, model_dir: Path, backend: str) -> None:
    result = run_train(tmp_path, model_dir, backend)
    history = result["history"]
    assert [row["iteration"] for row in history] == [0, 1, 2]
    last = history[-1]
    print(
        f"\n{backend}: rollout tokens/s {last.get('rollout_tokens_per_s')}, train tokens/s "
        f"{last.get('train_tokens_per_s')}, ppo step s {last.get('step_time_s')}, "
        f"GPU memory {result['gpu_memory_mib']} MiB"
    )
