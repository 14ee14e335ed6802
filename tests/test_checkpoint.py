"""Checkpoints: the model directory loads with from_pretrained, trainer state and RNGs resume exactly, and a save
killed halfway leaves the previous checkpoint in charge."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
    verified_latest_checkpoint,
    verify_checkpoint,
)
from lightning.models import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def train_step(model, optimizer, tokenizer) -> None:
    ids = torch.tensor([tokenizer.encode("What is 12 + 7? The answer is 19.")])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_model_and_tokenizer_round_trip(tmp_path: Path, model, tokenizer) -> None:
    meta = {"iteration": 4, "data_position": 128, "weight_version": "w4", "extra": {"run": "r1"}}
    path = save_checkpoint(tmp_path, 4, model, tokenizer, meta=meta)

    assert path == tmp_path / "step-000004"
    assert (tmp_path / "latest").read_text().strip() == "step-000004"
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    # transformers 4 (which vLLM may pin) cannot read transformers 5's tokenizer class name.
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"

    assert latest_checkpoint(tmp_path) == path
    ckpt = load_checkpoint(path)
    assert ckpt.step == 4 and ckpt.model_dir == path
    assert ckpt.meta["step"] == 4 and {k: ckpt.meta[k] for k in meta} == meta
    assert ckpt.trainer_state is None

    reloaded = AutoModelForCausalLM.from_pretrained(ckpt.model_dir)
    expected = model.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert reloaded.generation_config.eos_token_id == model.generation_config.eos_token_id
    reloaded_tokenizer = AutoTokenizer.from_pretrained(ckpt.model_dir)
    text = "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
    assert reloaded_tokenizer.encode(text) == tokenizer.encode(text)
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template


def test_trainer_state_and_rng_resume_exactly(tmp_path: Path, model, tokenizer, tiny_dir: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
    train_step(model, optimizer, tokenizer)
    scheduler.step()
    trainer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "iteration": 1}
    path = save_checkpoint(tmp_path, 1, model, tokenizer, trainer_state=trainer_state)

    # What the run would have drawn next, and the weights after one more step.
    expected_draws = (torch.rand(4), random.random(), np.random.rand(3))
    train_step(model, optimizer, tokenizer)
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    # Loads with weights_only=True: no pickled code runs on resume.
    ckpt = load_checkpoint(path)
    assert ckpt.trainer_state["iteration"] == 1
    restore_rng_state(ckpt.rng_state)
    draws = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(draws[0], expected_draws[0])
    assert draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])

    resumed = AutoModelForCausalLM.from_pretrained(ckpt.model_dir)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed_scheduler = torch.optim.lr_scheduler.LinearLR(resumed_optimizer, start_factor=0.5, total_iters=10)
    resumed_optimizer.load_state_dict(ckpt.trainer_state["optimizer"])
    resumed_scheduler.load_state_dict(ckpt.trainer_state["scheduler"])
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    train_step(resumed, resumed_optimizer, tokenizer)
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, expected_weights[name]), name


def test_trainer_state_that_weights_only_refuses_is_rejected_before_writing(tmp_path: Path, model, tokenizer) -> None:
    with pytest.raises(TypeError, match=r"trainer_state\['rng'\]\['numpy'\] is a numpy.ndarray"):
        save_checkpoint(tmp_path, 1, model, tokenizer, trainer_state={"rng": {"numpy": np.zeros(3)}})
    assert list(tmp_path.iterdir()) == []


CRASHING_SAVE = """
import sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from lightning.checkpoint import save_checkpoint

root, previous = sys.argv[1], sys.argv[2]

def stuck_save(obj, path, *args, **kwargs):
    # Half of the trainer state reaches the disk, then the process hangs until it is killed.
    with open(path, "wb") as f:
        f.write(b"\\0" * 4096)
    print("saving", flush=True)
    time.sleep(60)

torch.save = stuck_save
model = AutoModelForCausalLM.from_pretrained(previous)
tokenizer = AutoTokenizer.from_pretrained(previous)
save_checkpoint(root, 2, model, tokenizer, trainer_state={"weights": torch.zeros(1000)})
"""


@pytest.mark.slow
def test_save_killed_halfway_leaves_previous_checkpoint(tmp_path: Path, model, tokenizer) -> None:
    previous = save_checkpoint(tmp_path, 1, model, tokenizer, trainer_state={"iteration": 1})
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CRASHING_SAVE), str(tmp_path), str(previous)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "saving", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-000002-")]
    assert len(leftovers) == 1, "the kill should have landed mid-save"
    assert not (tmp_path / "step-000002").exists()
    assert latest_checkpoint(tmp_path) == previous
    ckpt = load_checkpoint(previous)
    assert ckpt.trainer_state == {"iteration": 1}
    AutoModelForCausalLM.from_pretrained(ckpt.model_dir)

    # The next save clears what the crash left.
    path = save_checkpoint(tmp_path, 2, model, tokenizer)
    assert latest_checkpoint(tmp_path) == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_keep_last_prunes_oldest(tmp_path: Path, model, tokenizer) -> None:
    (tmp_path / "step-000000").mkdir()  # an incomplete leftover, older than anything kept
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, tokenizer, keep_last=3)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000004", "step-000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000005"

    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in removed] == ["step-000003", "step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000005"]


def test_saving_a_step_again_replaces_it(tmp_path: Path, model, tokenizer) -> None:
    save_checkpoint(tmp_path, 3, model, tokenizer, meta={"weight_version": "first"})
    path = save_checkpoint(tmp_path, 3, model, tokenizer, meta={"weight_version": "second"})
    assert load_checkpoint(path).meta["weight_version"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000003"]


def test_corrupt_checkpoint_errors_name_path_and_what_is_missing(tmp_path: Path, model, tokenizer) -> None:
    assert latest_checkpoint(tmp_path / "nowhere") is None
    first = save_checkpoint(tmp_path, 1, model, tokenizer, trainer_state={"iteration": 1})
    second = save_checkpoint(tmp_path, 2, model, tokenizer, trainer_state={"iteration": 2})

    (second / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{second}.*missing model\.safetensors"):
        load_checkpoint(second)
    # Resuming falls back to the newest checkpoint that is whole.
    assert latest_checkpoint(tmp_path) == first

    (first / "trainer_state" / "state.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=rf"{first}.*trainer_state/state\.pt is 16 bytes, its manifest says"):
        load_checkpoint(first)
    (first / MANIFEST).unlink()  # a checkpoint from before manifests: only loading the file tells
    with pytest.raises(CheckpointError, match=rf"{first}: cannot load trainer_state/state\.pt"):
        load_checkpoint(first)

    with pytest.raises(CheckpointError, match="is a checkpoint root"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step-000009")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("truncate model", "model.safetensors is 100 bytes, its manifest says"),
        ("garble config", "config.json does not match the checksum its manifest recorded"),
        ("truncate state", "trainer_state/state.pt is 100 bytes"),
    ],
)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumed(
    tmp_path: Path, model, tokenizer, caplog: pytest.LogCaptureFixture, damage: str, said: str
) -> None:
    save_checkpoint(tmp_path, 1, model, tokenizer, trainer_state={"iteration": 1})
    newest = save_checkpoint(tmp_path, 2, model, tokenizer, trainer_state={"iteration": 2})
    target = {"truncate model": "model.safetensors", "garble config": "config.json"}.get(
        damage, "trainer_state/state.pt"
    )
    file = newest / target
    if damage == "garble config":  # same size, other bytes: only the checksum tells
        file.write_bytes(bytes(b ^ 0x20 for b in file.read_bytes()))
    else:
        file.write_bytes(file.read_bytes()[:100])

    with caplog.at_level("WARNING", logger="lightning.checkpoint"):
        resumed = verified_latest_checkpoint(tmp_path)
    assert resumed == tmp_path / "step-000001" and load_checkpoint(resumed).trainer_state == {"iteration": 1}
    # One line names the checkpoint, the file and what is wrong with it; the checkpoint is kept, set aside.
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and str(newest) in lines[0] and said in lines[0], lines
    assert [p.name.startswith("damaged-step-000002-") for p in tmp_path.iterdir() if p.name.startswith("damaged")] == [
        True
    ]
    assert latest_checkpoint(tmp_path) == resumed and (tmp_path / "latest").read_text().strip() == "step-000001"
    # The run then saves step 2 again, whole.
    again = save_checkpoint(tmp_path, 2, model, tokenizer, trainer_state={"iteration": 2})
    verify_checkpoint(again)
    assert verified_latest_checkpoint(tmp_path) == again
