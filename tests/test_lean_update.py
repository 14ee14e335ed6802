"""The update's fast paths against the plain path, on the CPU and the tiny model: each gives the same loss, metrics
and gradient as padded rows through the whole model (float32: log-probs within 1e-5, the gradient AdamW receives
within rtol 1e-4 / atol 1e-6, as gradient accumulation is held to), and does less work or holds less memory.

Paths: the old log-probs taken from the update's own forward when a batch is used once; packed rows without
padding (varlen attention); log-probs from hidden states a chunk of tokens at a time; micro-batches by a token
budget; gradient checkpointing; fused AdamW; bf16 weights with float32 master weights (bf16's own tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.losses import log_probs_from_hidden, token_log_probs
from lightning.algorithm.packing import packed_inputs, response_positions
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig, load_policy, loss_normalizers
from lightning.types import Triplet

BASE = {"lr": 1e-3, "micro_batch_size": 2, "use_kl_loss": True, "kl_coef": 0.1, "entropy_coef": 0.01}
"""KL loss and an entropy bonus: every term of the loss carries gradient through the paths compared."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, as tiny_dir


def mixed_batch(seed: int = 0, rows: int = 6, log_probs: bool = False) -> TrainingBatch:
    """Rows of prompt lengths 2..6 and response lengths 1..7 (lots of padding both sides), three groups, one
    tool-output token masked out of each response longer than one token."""
    generator = torch.Generator().manual_seed(seed)
    triplets = []
    for row in range(rows):
        prompt = torch.randint(0, 380, (2 + (row * 3) % 5,), generator=generator).tolist()
        response = torch.randint(0, 380, (1 + (row * 5) % 7,), generator=generator).tolist()
        mask = [1] * len(response)
        if len(response) > 1:
            mask[1] = 0
        metadata: dict[str, Any] = {"group_id": row % 3}
        if log_probs:
            metadata["response_log_probs"] = (-torch.rand(len(response), generator=generator)).tolist()
        reward = float(torch.rand(1, generator=generator))
        triplets.append(Triplet(prompt=prompt, response=response, response_mask=mask, reward=reward, metadata=metadata))
    return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def one_step(tiny_dir: Path, batch: TrainingBatch, **changes: Any) -> dict[str, Any]:
    """The log-probs before the step, the gradient AdamW receives (in the optimizer's parameter order) and the
    step's metrics."""
    trainer = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, **changes}), device="cpu")
    before = trainer.log_probs(trainer.model, batch)
    gradients: list[torch.Tensor] = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: gradients.extend(p.grad.float().clone() for p in trainer.trained_parameters())
    )
    metrics = trainer.step(batch)
    return {"log_probs": before, "gradients": gradients, "metrics": metrics, "trainer": trainer}


def assert_same_update(ours: dict[str, Any], plain: dict[str, Any], batch: TrainingBatch) -> None:
    real = batch["attention_mask"][:, batch.prompt_length :].bool()  # the lean forward leaves padding at 0
    torch.testing.assert_close(ours["log_probs"][real], plain["log_probs"][real], atol=1e-5, rtol=0)
    assert len(ours["gradients"]) == len(plain["gradients"]) > 0
    for mine, theirs in zip(ours["gradients"], plain["gradients"], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-4)
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "kl", "approx_kl", "clip_frac"):
        assert ours["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5, abs=1e-6), key


def saved_for_backward(trainer: TorchTrainer, batch: TrainingBatch) -> list[torch.Size]:
    """The shapes of the tensors autograd keeps for the backward pass of one micro-batch's loss."""
    prepared, _ = trainer.prepare(batch)
    shapes: list[torch.Size] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        trainer.micro_loss(prepared, loss_normalizers(prepared["response_mask"]))
    return shapes


def logit_rows(shapes: list[torch.Size], vocab: int) -> int:
    """The most rows of logits ([..., vocab] activations) among `shapes`, the output layer's weight [hidden, vocab]
    aside."""
    logits = [shape for shape in shapes if len(shape) > 1 and shape[-1] == vocab and shape != (64, vocab)]
    return max((shape.numel() // vocab for shape in logits), default=0)


# --- the old log-probs from the update's forward ----------------------------------------------


def count_forwards(trainer: TorchTrainer) -> list[bool]:
    calls: list[bool] = []
    trainer.model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize("log_probs", [False, True], ids=["trainer", "with-sampler-log-probs"])
def test_a_batch_used_once_takes_its_old_log_probs_from_the_update_forward(tiny_dir: Path, log_probs: bool) -> None:
    batch = mixed_batch(log_probs=log_probs)
    trainer = TorchTrainer(tiny_dir, TrainerConfig(**BASE), device="cpu")
    assert trainer.single_pass(batch)
    calls = count_forwards(trainer)
    skipped = trainer.step(batch)
    assert calls == [True, True, True]  # three micro-batches, each one forward with gradients: no no-grad pass

    # The same step with the no-grad old-log-prob forward first (what a second epoch or mini-batch needs).
    full = TorchTrainer(tiny_dir, TrainerConfig(**BASE), device="cpu")
    calls = count_forwards(full)
    prepared, prepare_metrics = full.prepare(batch)
    assert "old_log_probs" in prepared
    metrics = {**full.update(prepared), **prepare_metrics}
    assert calls == [False] * 3 + [True] * 3
    assert skipped["approx_kl"] == metrics["approx_kl"] == 0.0  # on-policy: ratio 1 exactly
    for key in ("loss", "pg_loss", "kl", "kl_loss", "entropy", "grad_norm"):
        assert skipped[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-7), key
    if log_probs:  # the engine-vs-trainer mismatch, from the update's forward
        for key in ("mismatch_mean", "mismatch_max", "mismatch_frac"):
            assert skipped[key] == pytest.approx(metrics[key], rel=1e-6), key
    for mine, theirs in zip(trainer.model.parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_a_batch_used_more_than_once_still_computes_its_old_log_probs_first(tiny_dir: Path) -> None:
    batch = mixed_batch()
    for changes in ({"ppo_epochs": 2}, {"mini_batch_size": 3}, {"kl_in_reward": True, "use_kl_loss": False}):
        trainer = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, **changes}), device="cpu")
        assert not trainer.single_pass(batch), changes
        calls = count_forwards(trainer)
        trainer.step(batch)
        assert calls[:3] == [False] * 3, changes


# --- packing, chunked log-probs, token budgets ------------------------------------------------


def test_packed_inputs_and_response_positions_by_hand() -> None:
    # Row 0: prompt [a b], response [c]; row 1: prompt [d], response [e f]. P = 2, R = 2, W = 4.
    input_ids = torch.tensor([[1, 2, 3, 0], [0, 4, 5, 6]])
    attention_mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 2]])
    ids, positions, cu_seqlens, longest = packed_inputs(input_ids, attention_mask, position_ids)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert cu_seqlens.tolist() == [0, 3, 6] and cu_seqlens.dtype == torch.int32 and longest == 3
    rows, columns, index = response_positions(attention_mask, 2, packed=True)
    assert list(zip(rows.tolist(), columns.tolist(), strict=True)) == [(0, 0), (1, 0), (1, 1)]
    assert index.tolist() == [1, 3, 4]  # b predicts c; d predicts e; e predicts f
    _, _, padded_index = response_positions(attention_mask, 2, packed=False)
    assert padded_index.tolist() == [1, 5, 6]  # the same tokens in the flattened [B x W] layout


def test_packed_rows_give_the_padded_update(tiny_dir: Path) -> None:
    batch = mixed_batch()
    assert_same_update(one_step(tiny_dir, batch, pack_sequences=True), one_step(tiny_dir, batch), batch)


def test_log_probs_by_chunks_give_the_whole_logits_update(tiny_dir: Path) -> None:
    batch = mixed_batch()
    assert_same_update(one_step(tiny_dir, batch, logit_chunk_tokens=3), one_step(tiny_dir, batch), batch)


def test_log_probs_by_chunks_by_hand_and_never_keep_the_whole_logits() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 4, generator=generator, requires_grad=True)
    weight = torch.randn(7, 4, generator=generator, requires_grad=True)
    labels = torch.randint(0, 7, (10,), generator=generator)
    whole, whole_entropy = log_probs_from_hidden(hidden, weight, labels, entropy_grad=True)
    torch.testing.assert_close(whole, token_log_probs(hidden @ weight.T, labels))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked, chunked_entropy = log_probs_from_hidden(hidden, weight, labels, chunk_tokens=3, entropy_grad=True)
    assert max(saved) < 10 * 7  # no [10 x 7] logits kept for the backward pass: each chunk's are recomputed
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_entropy, whole_entropy)
    grads = torch.autograd.grad((whole + whole_entropy).sum(), (hidden, weight))
    chunked_grads = torch.autograd.grad((chunked + chunked_entropy).sum(), (hidden, weight))
    for mine, theirs in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_the_lean_forward_keeps_no_full_logits_for_the_backward_pass(tiny_dir: Path) -> None:
    batch = mixed_batch()
    vocab = 384
    whole = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, "micro_batch_size": 6}), device="cpu")
    rows, width = batch["responses"].shape
    assert logit_rows(saved_for_backward(whole, batch), vocab) == rows * width  # plain: [B, R, vocab]
    lean_config = TrainerConfig(**{**BASE, "micro_batch_size": 6, "pack_sequences": True, "logit_chunk_tokens": 4})
    lean = TorchTrainer(tiny_dir, lean_config, device="cpu")
    assert logit_rows(saved_for_backward(lean, batch), vocab) == 0  # each chunk's logits are recomputed


def test_a_model_that_transforms_its_logits_is_refused_the_lean_forward(tiny_dir: Path) -> None:
    model = load_policy(tiny_dir)[0]
    model.config.final_logit_softcapping = 30.0  # as Gemma 2's: the logits are not the output layer's alone
    with pytest.raises(ValueError, match=r"this model \(LlamaForCausalLM\) transforms its logits"):
        TorchTrainer(model, TrainerConfig(logit_chunk_tokens=8), device="cpu")
    TorchTrainer(model, TrainerConfig(), device="cpu")  # the plain forward applies the model's own


def test_split_by_tokens_by_hand() -> None:
    batch = mixed_batch(rows=5)
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 11, 7, 8, 11]  # prompt + response of each row
    chunks = batch.split_by_tokens(15)  # 3 + 11 = 14; 7 + 8 = 15; 11
    assert [chunk["input_ids"].tolist() for chunk in chunks] == [
        batch["input_ids"][rows].tolist() for rows in ([0, 1], [2, 3], [4])
    ]
    assert [len(chunk) for chunk in batch.split_by_tokens(14)] == [2, 1, 1, 1]  # 14; 7 (+ 8 > 14); 8; 11
    assert [len(chunk) for chunk in batch.split_by_tokens(5)] == [1, 1, 1, 1, 1]  # longer rows go alone
    assert [len(chunk) for chunk in batch.split_by_tokens(100)] == [5]
    with pytest.raises(ValueError, match="at least 1"):
        batch.split_by_tokens(0)


def test_micro_batches_by_token_budget_give_the_row_count_update(tiny_dir: Path) -> None:
    batch = mixed_batch()
    ours = one_step(tiny_dir, batch, micro_batch_tokens=15)
    assert [len(micro) for micro in ours["trainer"].micro_batches(batch)] == [2, 2, 1, 1]  # 14, 15, 11, 7 tokens
    assert_same_update(ours, one_step(tiny_dir, batch), batch)


def test_every_lean_option_together_gives_the_plain_update(tiny_dir: Path) -> None:
    batch = mixed_batch(log_probs=True)
    lean = {"pack_sequences": True, "logit_chunk_tokens": 2, "micro_batch_tokens": 20, "gradient_checkpointing": True}
    assert_same_update(one_step(tiny_dir, batch, **lean), one_step(tiny_dir, batch), batch)


# --- memory and the optimizer -----------------------------------------------------------------


def test_gradient_checkpointing_gives_the_same_update_and_keeps_far_less(tiny_dir: Path) -> None:
    batch = mixed_batch()
    assert_same_update(one_step(tiny_dir, batch, gradient_checkpointing=True), one_step(tiny_dir, batch), batch)
    config = {**BASE, "micro_batch_size": 6}
    kept = sum(
        s.numel() for s in saved_for_backward(TorchTrainer(tiny_dir, TrainerConfig(**config), device="cpu"), batch)
    )
    checkpointed = TorchTrainer(tiny_dir, TrainerConfig(**config, gradient_checkpointing=True), device="cpu")
    assert sum(s.numel() for s in saved_for_backward(checkpointed, batch)) < kept / 3  # measured: 75k elements of 462k
    layer = checkpointed.model.model.layers[0]
    assert layer.training and not any(module.training for module in list(layer.modules())[1:])  # no dropout


def test_fused_adamw_takes_the_default_adamw_step(tiny_dir: Path) -> None:
    """The trainer asks for torch's fused AdamW on CUDA only; its CPU build of the same kernel stands in here."""
    assert TorchTrainer(tiny_dir, TrainerConfig(), device="cpu").optimizer.defaults["fused"] is None  # foreach
    steps = []
    for fused in (None, True):
        model = load_policy(tiny_dir)[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter) * 0.01
        optimizer.step()
        steps.append([p.detach().clone() for p in model.parameters()])
    for fused, default in zip(steps[1], steps[0], strict=True):
        torch.testing.assert_close(fused, default, atol=1e-7, rtol=0)


def test_bf16_weights_with_float32_master_weights(tiny_dir: Path, tmp_path: Path) -> None:
    batch = mixed_batch()
    plain = one_step(tiny_dir, batch)
    ours = one_step(tiny_dir, batch, bf16_weights=True)
    trainer = ours["trainer"]
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert trainer.reference is not None and next(trainer.reference.parameters()).dtype == torch.bfloat16
    # bf16's tolerance: 8 bits of mantissa (relative spacing 2^-8 ~ 0.4%), over two layers.
    real = batch["attention_mask"][:, batch.prompt_length :].bool()
    torch.testing.assert_close(ours["log_probs"][real], plain["log_probs"][real], atol=0.2, rtol=0)
    assert ours["metrics"]["loss"] == pytest.approx(plain["metrics"]["loss"], abs=1e-2)
    mine = torch.cat([g.flatten() for g in ours["gradients"]])
    theirs = torch.cat([g.flatten() for g in plain["gradients"]])
    assert float(torch.nn.functional.cosine_similarity(mine, theirs, dim=0)) > 0.99
    # The model holds its master weights' bf16 rounding; an update far below a weight's bf16 spacing is kept in the
    # master copy, where bf16 weights alone would drop it.
    for master, weight in zip(trainer.master_weights.params, trainer.model.parameters(), strict=True):
        assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), weight)
    small = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, "lr": 1e-5, "bf16_weights": True}), device="cpu")
    norm = small.model.model.norm.weight  # all ones: bf16 spacing 2^-8 below 1, 2^-7 above
    master = small.master_weights.params[[p is norm for p in small.model.parameters()].index(True)]
    small.step(batch)
    assert torch.equal(norm, torch.ones_like(norm))  # the 1e-5 step is lost in bf16 ...
    assert (master - 1).abs().min() > 5e-6  # ... and kept in float32


def test_bf16_weights_resume_bit_exact_through_a_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    from lightning.checkpoint import latest_checkpoint, load_checkpoint, resume_trainer, save_checkpoint

    config = TrainerConfig(**{**BASE, "bf16_weights": True})
    first = TorchTrainer(tiny_dir, config, device="cpu")
    first.step(mixed_batch(0))
    save_checkpoint(tmp_path / "ckpt", 1, first.model, first.tokenizer, trainer_state=first.state_dict())
    expected = first.step(mixed_batch(1))

    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    resumed = TorchTrainer(checkpoint.model_dir, config, reference=tiny_dir, device="cpu")
    resume_trainer(resumed, checkpoint)
    assert resumed.step(mixed_batch(1))["loss"] == expected["loss"]
    for mine, theirs in zip(resumed.master_weights.params, first.master_weights.params, strict=True):
        assert torch.equal(mine, theirs)
    without = TorchTrainer(checkpoint.model_dir, TrainerConfig(**BASE), device="cpu").state_dict()
    with pytest.raises(ValueError, match="bf16_weights: this trainer state has no float32 master weights"):
        resumed.load_state_dict(without)


# --- on a GPU (never in CI) -------------------------------------------------------------------


@pytest.mark.gpu
def test_on_a_gpu_packed_rows_with_varlen_flash_attention_give_the_padded_update(tiny_dir: Path) -> None:
    """bf16 autocast on both sides; packed rows take torch's varlen flash attention, padded ones SDPA with a mask."""
    batch = mixed_batch()
    results = []
    for changes in ({}, {"pack_sequences": True, "logit_chunk_tokens": 8}):
        trainer = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, **changes}), device="cuda")
        assert trainer.optimizer.defaults["fused"] is True
        gradients: list[torch.Tensor] = []
        trainer.optimizer.register_step_pre_hook(
            lambda *_, t=trainer, g=gradients: g.extend(p.grad.float().cpu() for p in t.trained_parameters())
        )
        results.append((trainer.step(batch), torch.cat([g.flatten() for g in gradients])))
    (plain, plain_grad), (packed, packed_grad) = results
    assert packed["loss"] == pytest.approx(plain["loss"], abs=2e-2)
    assert float(torch.nn.functional.cosine_similarity(packed_grad, plain_grad, dim=0)) > 0.99
