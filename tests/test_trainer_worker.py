"""TrainerWorker: a real TorchTrainer in a real child process, its deadlines, crashes, errors and bit-exact resume."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig
from lightning.algorithm.worker import TrainerCrashed, TrainerError, TrainerTimeout, TrainerWorker
from lightning.models import build_tiny_model
from lightning.types import Triplet

# The KL reference is on so that resuming must anchor it to the original model, not the checkpoint.
CONFIG = TrainerConfig(lr=1e-3, lr_schedule="cosine", total_steps=5, micro_batch_size=2, use_kl_loss=True, kl_coef=0.1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two small batch files of four rows in two groups."""
    root = tmp_path_factory.mktemp("batches")
    paths = []
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        triplets = [
            Triplet(
                prompt=torch.randint(0, 380, (2 + row % 3,), generator=generator).tolist(),
                response=torch.randint(0, 380, (2 + row,), generator=generator).tolist(),
                reward=float(torch.rand(1, generator=generator)),
                metadata={"group_id": row % 2},
            )
            for row in range(4)
        ]
        batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)
        paths.append(batch.save(root / f"batch-{seed}"))
    return paths


def worker(tiny_dir: Path, checkpoint_root: Path) -> TrainerWorker:
    return TrainerWorker(tiny_dir, CONFIG, checkpoint_root, threads=1, start_timeout=120)


def weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(Path(checkpoint) / "model.safetensors")


@pytest.mark.slow
def test_resumed_worker_matches_one_that_never_stopped(tiny_dir: Path, batches: list[Path], tmp_path: Path) -> None:
    with worker(tiny_dir, tmp_path / "uninterrupted") as uninterrupted:
        assert uninterrupted.resumed_from is None
        first = uninterrupted.step(batches[0], timeout=60)
        assert first["step"] == 1.0 and "loss" in first
        uninterrupted.step(batches[1], timeout=60)
        expected = uninterrupted.save_checkpoint(2, timeout=60)

    with worker(tiny_dir, tmp_path / "interrupted") as before:
        before.step(batches[0], timeout=60)
        saved = before.save_checkpoint(1, meta={"iteration": 1}, timeout=60)
    assert Path(saved) == tmp_path / "interrupted" / "step-000001"
    assert (Path(saved) / "model.safetensors").is_file()

    with worker(tiny_dir, tmp_path / "interrupted") as after:
        assert after.resumed_from == 1
        assert after.step(batches[1], timeout=60)["step"] == 2.0
        resumed = after.save_checkpoint(2, timeout=60)

    expected_weights, resumed_weights = weights(expected), weights(resumed)
    assert expected_weights.keys() == resumed_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name


@pytest.mark.slow
def test_a_call_past_its_deadline_kills_the_child_and_the_next_call_restarts_it(
    tiny_dir: Path, batches: list[Path], tmp_path: Path
) -> None:
    with worker(tiny_dir, tmp_path / "ckpt") as trainer:
        trainer.step(batches[0], timeout=60)
        trainer.save_checkpoint(1, timeout=60)
        started = time.monotonic()
        with pytest.raises(TrainerTimeout, match=r"sleep did not answer within 0.5s.*latest checkpoint"):
            trainer._call({"op": "sleep", "seconds": 30}, timeout=0.5)
        assert time.monotonic() - started < 5
        assert not trainer.alive
        assert trainer.step(batches[1], timeout=60)["step"] == 2.0  # resumed from the step 1 checkpoint
        assert trainer.alive and trainer.resumed_from == 1


@pytest.mark.slow
def test_an_error_in_the_trainer_is_reported_and_the_worker_stays_usable(
    tiny_dir: Path, batches: list[Path], tmp_path: Path
) -> None:
    with worker(tiny_dir, tmp_path / "ckpt") as trainer:
        pid = trainer.pid
        with pytest.raises(TrainerError, match=r"step failed: FileNotFoundError.*no-such-batch"):
            trainer.step(tmp_path / "no-such-batch", timeout=60)
        assert trainer.alive and trainer.pid == pid
        assert trainer.step(batches[0], timeout=60)["step"] == 1.0
        assert trainer.pid == pid


@pytest.mark.slow
def test_a_killed_child_is_reported_once_then_restarted(tiny_dir: Path, batches: list[Path], tmp_path: Path) -> None:
    with worker(tiny_dir, tmp_path / "ckpt") as trainer:
        assert trainer.pid is not None
        os.kill(trainer.pid, signal.SIGKILL)
        with pytest.raises(TrainerCrashed, match=f"exit code {-signal.SIGKILL}"):
            trainer.step(batches[0], timeout=60)
        assert trainer.step(batches[0], timeout=60)["step"] == 1.0
        assert trainer.resumed_from is None  # nothing was saved: it starts over from the model
    assert not trainer.alive
    trainer.close()  # twice is fine


def test_the_trainer_takes_half_the_cores_on_a_cpu_so_its_threads_do_not_stall_behind_the_other_processes() -> None:
    from lightning.algorithm.worker import default_threads

    assert [default_threads(cores, cuda=False) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]


@pytest.mark.slow
def test_a_supervised_step_on_some_rows_of_the_batch_file(tiny_dir: Path, batches: list[Path], tmp_path: Path) -> None:
    """`sft_step(rows=...)`: the step learns from those rows of the file only (a warm start's `batch_size`), as a
    trainer given just those rows does."""
    rows = [3, 1]
    batch = TrainingBatch.load(batches[0])
    expected = TorchTrainer(tiny_dir, CONFIG, reference=tiny_dir).sft_step(batch.select(rows), lr=1e-2)["sft_loss"]
    every_row = TorchTrainer(tiny_dir, CONFIG, reference=tiny_dir).sft_step(batch, lr=1e-2)["sft_loss"]
    with worker(tiny_dir, tmp_path / "ckpt") as trainer:
        assert trainer.sft_step(batches[0], timeout=60, lr=1e-2, rows=rows)["sft_loss"] == pytest.approx(expected)
    assert expected != pytest.approx(every_row)
