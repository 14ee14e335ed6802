"""Off-policy correction in the PPO loss, on numbers worked by hand: decoupled PPO's and truncated importance
sampling's weights pi_old / pi_behav times the clipped surrogate, their metrics, and the trainer using them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.losses import behaviour_weights, clipped_policy_loss, importance_metrics
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig
from lightning.types import Triplet

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Three sampled tokens of one row (the third is padding: mask 0).
#
#                    token 0       token 1       token 2 (masked)
#   pi_behav         0.25          0.5           0.9       the sampler's probability (stale weights)
#   pi_old           0.5           0.25          0.1       the trainer's before the update (the proximal policy)
#   pi               0.75          0.25          0.1       the policy being updated
#   A                +1            -1            +1
#
#   w = pi_old / pi_behav           2             0.5       (0.1 / 0.9: masked out)
#   ratio = pi / pi_old             1.5           1.0
#   clip(ratio, 0.8, 1.2)           1.2           1.0
#   L = max(-A r, -A clip(r))       max(-1.5, -1.2) = -1.2    max(1, 1) = 1   (dual clip: 1 < 3, not hit)
#
#   plain PPO, token-mean:          (-1.2 + 1) / 2            = -0.1
#   decoupled PPO, w * L:           (2 * -1.2 + 0.5 * 1) / 2  = (-2.4 + 0.5) / 2 = -0.95
#   TIS, cap 1.5, min(w, C) * L:    (1.5 * -1.2 + 0.5 * 1) / 2 = (-1.8 + 0.5) / 2 = -0.65
#   metrics over the 2 real tokens: is_ratio_mean (2 + 0.5) / 2 = 1.25, is_ratio_max 2, above the cap 1.5: 1 of 2.
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.5, 0.9]]))
OLD = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
NEW = torch.log(torch.tensor([[0.75, 0.25, 0.1]]))
ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_the_importance_weight_is_pi_old_over_pi_behav_truncated_for_tis() -> None:
    torch.testing.assert_close(behaviour_weights(OLD, BEHAVIOUR)[:, :2], torch.tensor([[2.0, 0.5]]))
    torch.testing.assert_close(behaviour_weights(OLD, BEHAVIOUR, cap=1.5)[:, :2], torch.tensor([[1.5, 0.5]]))


def test_decoupled_ppo_and_tis_weigh_the_clipped_loss_by_hand() -> None:
    plain, _ = clipped_policy_loss(NEW, OLD, ADVANTAGES, MASK)
    decoupled, _ = clipped_policy_loss(NEW, OLD, ADVANTAGES, MASK, importance_weights=behaviour_weights(OLD, BEHAVIOUR))
    tis, metrics = clipped_policy_loss(
        NEW, OLD, ADVANTAGES, MASK, importance_weights=behaviour_weights(OLD, BEHAVIOUR, cap=1.5)
    )
    assert float(plain) == pytest.approx(-0.1, abs=1e-6)
    assert float(decoupled) == pytest.approx(-0.95, abs=1e-6)
    assert float(tis) == pytest.approx(-0.65, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)  # token 0's ratio 1.5 is clipped, weight or not


def test_the_weight_scales_the_gradient_and_gets_none_itself() -> None:
    # d(w * -A * r)/d log pi = -A * w * r at r = 1 (pi = pi_old): token 0: -1 * 2 / 2 tokens = -1; token 1: 0.5 / 2.
    log_probs = OLD.clone().requires_grad_(True)
    old = OLD.clone().requires_grad_(True)
    weights = behaviour_weights(old, BEHAVIOUR)
    loss, _ = clipped_policy_loss(log_probs, OLD, ADVANTAGES, MASK, importance_weights=weights)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 0.25, 0.0]]))
    assert old.grad is None


def test_importance_metrics_by_hand() -> None:
    metrics = importance_metrics(OLD, BEHAVIOUR, MASK, cap=1.5)
    assert metrics == pytest.approx({"is_ratio_mean": 1.25, "is_ratio_max": 2.0, "is_ratio_clipped_frac": 0.5})
    assert importance_metrics(OLD, BEHAVIOUR, MASK, cap=None)["is_ratio_clipped_frac"] == 0.0
    # A token the stale sampler gave e^-50 stays finite: the log-ratio log 0.5 + 50 is clamped to 20.
    far = importance_metrics(OLD, torch.full_like(OLD, -50.0), MASK, cap=None)
    assert far["is_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def tiny_batch() -> TrainingBatch:
    """Four rows of random tokens of the tiny model's vocabulary, in two groups, with different rewards."""
    generator = torch.Generator().manual_seed(0)
    triplets = [
        Triplet(
            prompt=torch.randint(0, 380, (2 + row % 3,), generator=generator).tolist(),
            response=torch.randint(0, 380, (2 + row,), generator=generator).tolist(),
            reward=float(row),
            metadata={"group_id": row % 2},
        )  # fmt: skip
        for row in range(4)
    ]
    return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def test_the_trainer_weighs_its_loss_with_the_sampler_s_log_probs(tiny_dir: Path) -> None:
    """On its first pass pi = pi_old, so the loss is -mean(w * A); with the sampler's log-probs equal to the
    trainer's, w = 1 and the loss is plain PPO's; 0.1 nats below them on every token, w = e^0.1 (TIS: capped)."""
    batch = tiny_batch()
    probe = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3), device="cpu")
    own = probe.log_probs(probe.model, batch.to(probe.device))
    plain = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3), device="cpu").step(batch)

    same = batch.with_tensors({"rollout_log_probs": own})
    for correction in ("decoupled", "tis"):
        config = TrainerConfig(lr=1e-3, off_policy_correction=correction)
        metrics = TorchTrainer(tiny_dir, config, device="cpu").step(same)
        assert metrics["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-6)
        assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert metrics["is_ratio_clipped_frac"] == 0.0

    stale = batch.with_tensors({"rollout_log_probs": own - 0.1})
    decoupled = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3, off_policy_correction="decoupled"), device="cpu")
    metrics = decoupled.step(stale)
    assert metrics["pg_loss"] == pytest.approx(math.exp(0.1) * plain["pg_loss"], abs=1e-5)
    assert metrics["is_ratio_max"] == pytest.approx(math.exp(0.1), abs=1e-5)
    tis = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3, off_policy_correction="tis", tis_cap=1.05), device="cpu")
    metrics = tis.step(stale)
    assert metrics["pg_loss"] == pytest.approx(1.05 * plain["pg_loss"], abs=1e-5)
    assert metrics["is_ratio_clipped_frac"] == 1.0


def test_off_policy_correction_needs_the_trainer_s_old_log_probs() -> None:
    with pytest.raises(ValueError, match="old_log_probs 'trainer'"):
        TrainerConfig(off_policy_correction="tis", old_log_probs="sampler")
