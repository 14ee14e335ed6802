"""RL math against numbers computed by hand, the TrainingBatch layout, and the torch trainer on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning.algorithm.advantages import (
    discounted_returns,
    failed_group_advantages,
    grpo_advantages,
    kl_penalized_scores,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    zero_std_group_fraction,
)
from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.losses import (
    aggregate,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_log_probs,
)
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig, loss_normalizers, lr_multiplier
from lightning.checkpoint import capture_rng_state, restore_rng_state
from lightning.config import WarmStart
from lightning.types import Triplet

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, as tiny_dir


def assert_close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- advantages -------------------------------------------------------------------------------
# Two groups of three rows: group "a" scores 1, 2, 3 and group "b" scores 0, 0, 1, each reward on the last
# real token of a response of length 3, 2, 1, 3, 3, 2 (R = 3).

UID = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
SCORES = torch.tensor(
    [[0, 0, 1.0], [0, 2.0, 0], [3.0, 0, 0], [0, 0, 0.0], [0, 0, 0.0], [0, 1.0, 0]],
)


def broadcast(per_row: list[float]) -> list[list[float]]:
    return [[a * m for m in row] for a, row in zip(per_row, MASK.tolist(), strict=True)]


def test_grpo_divides_by_the_unbiased_group_std() -> None:
    # a: mean 2, std sqrt((1 + 0 + 1) / 2) = 1.  b: mean 1/3, std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = 1/sqrt(3).
    s3 = math.sqrt(3)
    expected = [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), -s3 / 3, -s3 / 3, 2 * s3 / 3]
    assert_close(grpo_advantages(SCORES, MASK, UID), broadcast(expected))


def test_grpo_without_std_only_subtracts_the_group_mean() -> None:
    assert_close(grpo_advantages(SCORES, MASK, UID, norm_by_std=False), broadcast([-1, 0, 1, -1 / 3, -1 / 3, 2 / 3]))


def test_grpo_group_of_one_has_mean_zero_and_std_one() -> None:
    assert_close(grpo_advantages(torch.tensor([[0, 5.0]]), torch.tensor([[1, 1]]), ["solo"]), [[5 / 1.000001] * 2])


def test_grpo_all_equal_group_gives_zero_advantage() -> None:
    assert_close(grpo_advantages(torch.tensor([[1.0], [1.0]]), torch.tensor([[1], [1]]), ["g", "g"]), [[0.0], [0.0]])


def test_a_group_that_failed_alike_gets_the_failed_group_advantage_on_its_response_tokens() -> None:
    # Group b all 0 (failed), group a all 2 (flat but not failed), c one row of 0 (no group), d 0 and 1 (differs).
    uid = ["a", "a", "b", "b", "c", "d", "d"]
    scores = torch.tensor([[2.0, 0], [0, 2.0], [0, 0.0], [0, 0.0], [0, 0.0], [0, 0.0], [1.0, 0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    grpo = grpo_advantages(scores, mask, uid)
    result = failed_group_advantages(grpo, scores, mask, uid, -0.5)
    assert_close(result[2:4], [[-0.5, -0.5], [-0.5, 0.0]])
    torch.testing.assert_close(result[[0, 1, 4, 5, 6]], grpo[[0, 1, 4, 5, 6]])


def test_the_trainer_pushes_down_the_answers_of_a_failed_group(tiny_dir: Path) -> None:
    """A failed group's rows get the advantage whatever the KL penalty did to their rewards, and the update lowers
    their log-probs."""
    config = TrainerConfig(lr=1e-2, kl_in_reward=True, kl_coef=0.5, failed_group_advantage=-1.0, micro_batch_size=8)
    trainer = TorchTrainer(tiny_dir, config, device="cpu")
    triplets = [
        Triplet(prompt=[5, 6, 7], response=[8 + i % 2, 9], reward=0.0, metadata={"group_id": "lost"}) for i in range(4)
    ] + [
        Triplet(prompt=[5, 6, 7], response=[10, 9], reward=float(i % 2), metadata={"group_id": "mixed"})
        for i in range(4)
    ]
    batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=4, max_response_length=3)
    prepared, _ = trainer.prepare(batch)
    mask = batch["response_mask"].float()
    torch.testing.assert_close(prepared["advantages"][:4], -1.0 * mask[:4])
    before = trainer.log_probs(trainer.model, batch)[:4].sum()
    trainer.step(batch)
    assert trainer.log_probs(trainer.model, batch)[:4].sum() < before


def test_rloo_subtracts_the_mean_of_the_other_rows() -> None:
    # a: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5.  b: 0 - 0.5, 0 - 0.5, 1 - 0.
    assert_close(rloo_advantages(SCORES, MASK, UID), broadcast([-1.5, 0, 1.5, -0.5, -0.5, 1.0]))


def test_rloo_group_of_one_keeps_its_score() -> None:
    assert_close(rloo_advantages(torch.tensor([[0, 4.0]]), torch.tensor([[1, 1]]), ["solo"]), [[4.0, 4.0]])


def test_discounted_returns_run_backwards_and_skip_masked_tokens() -> None:
    rewards = torch.tensor([[0, 0, 1.0], [0, 2.0, 0], [0, 0, 1.0], [0, 0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 1]])
    # Row 0, gamma 0.5: 1, 0.5, 0.25.  Row 1: 0 at the pad, 2, then 0 + 0.5 * 2 = 1.
    # Row 2 (verl 0.9): a reward on a masked-out token is dropped.
    # Row 3: the masked tool-output token gets 0 and passes the return through undiscounted: 1, 0, 0 + 0.5 * 1.
    expected = [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 1.0]]
    assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)


def test_masked_whiten_uses_masked_mean_and_unbiased_variance() -> None:
    # Masked 1, 2, 3: mean 2, unbiased variance (1 + 0 + 1) / 2 = 1; the masked 100 is not counted.
    whitened = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert_close(whitened[:, :3], [[-1.0, 0.0, 1.0]])


def test_reinforce_pp_whitens_returns_over_the_batch() -> None:
    # Returns (gamma 1): row 0 [3, 3], row 1 [1, 0 (masked)]. Masked 3, 3, 1: mean 7/3,
    # unbiased variance ((2/3)^2 + (2/3)^2 + (4/3)^2) / 2 = 4/3, std 2/sqrt(3).
    scores = torch.tensor([[0, 3.0], [1.0, 0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    std = 2 / math.sqrt(3)
    assert_close(
        reinforce_pp_advantages(scores, mask, gamma=1.0), [[(2 / 3) / std, (2 / 3) / std], [(-4 / 3) / std, 0.0]]
    )


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    # Group a scores 1, 3 -> -1, +1; group b alone, score 2, mean 0 -> 2. Per token: [-1, -1], [1, pad], [2, 2].
    # Masked -1, -1, 1, 2, 2: mean 0.6, unbiased variance (1.6^2 * 2 + 0.4^2 + 1.4^2 * 2) / 4 = 2.3.
    scores = torch.tensor([[0, 1.0], [3.0, 0], [0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    std = math.sqrt(2.3)
    expected = [[-1.6 / std, -1.6 / std], [0.4 / std, 0.0], [1.4 / std, 1.4 / std]]
    assert_close(reinforce_pp_baseline_advantages(scores, mask, ["a", "a", "b"]), expected)


def test_kl_in_reward_subtracts_coef_times_kl_on_generated_tokens() -> None:
    # k1 = old - ref = [0.5, -1, 9 (masked)] -> scores - 0.1 * k1 * mask.
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    shaped = kl_penalized_scores(
        scores,
        torch.tensor([[-1.0, -2.0, -1.0]]),
        torch.tensor([[-1.5, -1.0, -10.0]]),
        torch.tensor([[1, 1, 0]]),
        0.1,
        "k1",
    )
    assert_close(shaped, [[-0.05, 1.1, 0.0]])


def test_zero_std_group_fraction_counts_flat_groups_of_two_or_more() -> None:
    scores = torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0], [7.0]])
    assert zero_std_group_fraction(scores, ["a", "a", "a", "b", "b", "solo"]) == 0.5


# --- losses -----------------------------------------------------------------------------------


def test_token_log_probs_and_entropy() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    assert_close(token_log_probs(logits, torch.tensor([[1, 0]])), [[math.log(0.75), math.log(0.25)]])
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), [[entropy, entropy]])


LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row has no token: left out of seq means


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / 2 / 3),  # Dr. GRPO: over the constant 3 (R), not each row's length
    ],
)
def test_aggregate_modes(mode: str, expected: float) -> None:
    assert_close(aggregate(LOSS_MAT, LOSS_MASK, mode), expected)


def test_dr_grpo_normalisation_divides_by_the_constant_given() -> None:
    # Rows of 3 and 1 tokens weigh per token alike: (6 + 4) / 2 sequences / 8 (the generation budget).
    assert_close(aggregate(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm", loss_scale_factor=8), 10 / 2 / 8)


def test_aggregate_with_batch_counts_adds_up_over_micro_batches() -> None:
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(LOSS_MAT, LOSS_MASK, mode)
        counts = loss_normalizers(LOSS_MASK)
        parts = sum(aggregate(LOSS_MAT[i : i + 1], LOSS_MASK[i : i + 1], mode, **counts) for i in range(3))
        assert_close(parts, whole.item())
    assert_close(aggregate(LOSS_MAT, LOSS_MASK, "token-mean", batch_num_tokens=8), 10 / 8)


# Four tokens, one per case, and a fifth masked token that must not count:
#   A=+1 ratio 1.5: max(-1.5, -1.2) = -1.2   clipped
#   A=+1 ratio 0.5: max(-0.5, -0.8) = -0.5
#   A=-1 ratio 0.5: max( 0.5,  0.8) =  0.8   clipped
#   A=-1 ratio 5.0: max( 5.0,  1.2) =  5.0, dual clip min(5, 3) = 3   dual-clipped
RATIOS = [1.5, 0.5, 0.5, 5.0, 100.0]
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0, 50.0]])
POLICY_MASK = torch.tensor([[1, 1, 1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -4.0]])
NEW = OLD + torch.log(torch.tensor([RATIOS]))


def test_clipped_policy_loss_clip_and_dual_clip() -> None:
    loss, metrics = clipped_policy_loss(NEW, OLD, ADVANTAGES, POLICY_MASK)
    assert_close(loss, (-1.2 - 0.5 + 0.8 + 3.0) / 4)
    assert_close(metrics["clip_frac"], 2 / 4)
    assert_close(metrics["dual_clip_frac"], 1 / 4)
    assert_close(metrics["approx_kl"], -(math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 4)


def test_clipped_policy_loss_clip_higher() -> None:
    loss, _ = clipped_policy_loss(NEW, OLD, ADVANTAGES, POLICY_MASK, clip_low=0.2, clip_high=0.28)
    assert_close(loss, (-1.28 - 0.5 + 0.8 + 3.0) / 4)


def test_clipped_policy_loss_gradient_is_minus_advantage_at_ratio_one() -> None:
    log_probs = OLD.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(log_probs, OLD, ADVANTAGES, POLICY_MASK)
    loss.backward()
    assert_close(log_probs.grad, [[-0.25, -0.25, 0.25, 0.25, 0.0]])


def test_kl_penalty_k1_and_low_var_kl() -> None:
    log_p, log_q = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert_close(kl_penalty(log_p, log_q, "k1"), [math.log(2.0)])
    assert_close(kl_penalty(log_p, log_q, "low_var_kl"), [0.5 - math.log(0.5) - 1])  # q/p - log(q/p) - 1
    assert_close(kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl"), [10.0])  # clamped


def test_lr_multiplier_warmup_then_constant_or_cosine() -> None:
    constant = {"warmup_steps": 4, "schedule": "constant", "total_steps": None, "min_lr_ratio": 0.0}
    assert [lr_multiplier(s, **constant) for s in (0, 2, 4, 99)] == [0.0, 0.5, 1.0, 1.0]
    cosine = {"warmup_steps": 0, "schedule": "cosine", "total_steps": 10, "min_lr_ratio": 0.1}
    assert [round(lr_multiplier(s, **cosine), 6) for s in (0, 5, 10, 20)] == [1.0, 0.55, 0.1, 0.1]


def test_warm_start_lr_constant_or_cosine_to_zero_over_its_steps() -> None:
    warm = WarmStart(demonstrations="examples.copy_task.agent:demonstrations", steps=10)
    assert {warm.step_lr(s, 0.01) for s in range(10)} == {0.01}
    cosine = warm.model_copy(update={"lr_schedule": "cosine"})
    assert [round(cosine.step_lr(s, 0.01), 6) for s in (0, 5, 9)] == [0.01, 0.005, 0.000245]


# --- TrainingBatch ----------------------------------------------------------------------------


def three_triplets() -> list[Triplet]:
    return [
        Triplet(prompt=[11, 12], response=[21, 22, 23], reward=1.0, metadata={"group_id": "a", "turn": 0}),
        Triplet(prompt=[13], response=[24], reward=0.5, metadata={"group_id": "a", "turn": 1}),
        Triplet(prompt=[14, 15, 16], response=[25, 26, 27, 28], response_mask=[1, 1, 0, 1], reward=-1.0,
                metadata={"group_id": "b"}),
    ]  # fmt: skip


def test_batch_layout() -> None:
    batch = TrainingBatch.from_triplets(three_triplets(), pad_token_id=0, max_prompt_length=3, max_response_length=4)
    assert batch["prompts"].tolist() == [[0, 11, 12], [0, 0, 13], [14, 15, 16]]
    assert batch["responses"].tolist() == [[21, 22, 23, 0], [24, 0, 0, 0], [25, 26, 27, 28]]
    assert batch["input_ids"].tolist() == [
        [0, 11, 12, 21, 22, 23, 0],
        [0, 0, 13, 24, 0, 0, 0],
        [14, 15, 16, 25, 26, 27, 28],
    ]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 1]]
    assert batch["token_level_scores"].tolist() == [[0, 0, 1.0, 0], [0.5, 0, 0, 0], [0, 0, 0, -1.0]]
    assert batch["token_level_scores"].dtype == torch.float32
    assert batch.uid.dtype == object and batch.uid.tolist() == ["a", "a", "b"]
    assert [m.get("turn") for m in batch.metadata] == [0, 1, None]
    assert len(batch) == 3 and batch.prompt_length == 3
    assert batch.dropped.counts() == dict.fromkeys(batch.dropped.counts(), 0)


def test_batch_drops_long_prompts_and_truncates_long_responses() -> None:
    triplets = [
        Triplet(prompt=[1, 2, 3, 4], response=[5], reward=1.0, metadata={"group_id": "g"}),  # prompt too long
        Triplet(prompt=[1], response=[5, 6, 7, 8, 9, 10], response_mask=[1, 1, 0, 1, 1, 1], reward=2.0,
                metadata={"group_id": "g"}),  # truncated to 4 tokens
        Triplet(prompt=[1], response=[], reward=1.0, metadata={"group_id": "g"}),  # empty response
        Triplet(prompt=[1], response=[5], reward=None, metadata={"group_id": "g"}),  # no reward
        Triplet(prompt=[1, 2, 3], response=[5], reward=3.0),  # no group id: a group of its own
    ]  # fmt: skip
    batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=3, max_response_length=4)
    report = batch.dropped
    assert (report.prompt_too_long, report.empty_response, report.missing_reward) == ([0], [2], [3])
    assert (report.response_truncated, report.missing_group_id, report.num_dropped) == ([1], [4], 3)
    assert report.rules["prompt_too_long"].startswith("dropped")
    assert batch["responses"].tolist() == [[5, 6, 7, 8], [5, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert batch["token_level_scores"].tolist() == [[0, 0, 0, 2.0], [3.0, 0, 0, 0]]
    assert batch.uid.tolist() == ["g", "row-4"]
    summary = batch.report()
    assert (summary["rows"], summary["triplets"], summary["prompt_too_long"], summary["response_truncated"]) == (
        2,
        5,
        1,
        1,
    )
    with pytest.raises(ValueError, match="no trainable row"):
        TrainingBatch.from_triplets(triplets[:1], pad_token_id=0, max_prompt_length=3, max_response_length=4)


def test_batch_rejects_a_prompt_that_is_not_token_ids() -> None:
    with pytest.raises(ValueError, match="list of token ids"):
        TrainingBatch.from_triplets(
            [Triplet(prompt="hello", response=[1], reward=1.0)],
            pad_token_id=0,
            max_prompt_length=8,
            max_response_length=8,
        )


def test_batch_takes_rollout_log_probs_when_every_row_has_them() -> None:
    triplets = [
        Triplet(prompt=[1], response=[2, 3], reward=1.0, metadata={"group_id": "g", "response_log_probs": [-0.5, -1]}),
        Triplet(prompt=[1], response=[4], reward=0.0, metadata={"group_id": "g", "response_log_probs": [-2.0]}),
    ]
    batch = TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    assert batch["rollout_log_probs"].tolist() == [[-0.5, -1.0], [-2.0, 0.0]]
    assert "response_log_probs" not in batch.metadata[0]


def test_batch_save_load_round_trip(tmp_path: Path) -> None:
    batch = TrainingBatch.from_triplets(three_triplets(), pad_token_id=0, max_prompt_length=3, max_response_length=4)
    loaded = TrainingBatch.load(batch.save(tmp_path / "batch"))
    assert loaded.tensors.keys() == batch.tensors.keys()
    for key, value in batch.tensors.items():
        assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype, key
    assert loaded.uid.dtype == object and loaded.uid.tolist() == batch.uid.tolist()
    assert loaded.metadata == batch.metadata
    assert loaded.dropped == batch.dropped and loaded.meta_info == batch.meta_info
    assert not list((tmp_path / "batch").glob("*.pkl")) and not list((tmp_path / "batch").glob("*.pt"))


def test_batch_select_and_split() -> None:
    batch = TrainingBatch.from_triplets(three_triplets(), pad_token_id=0, max_prompt_length=3, max_response_length=4)
    picked = batch.select([2, 0])
    assert picked.uid.tolist() == ["b", "a"] and picked["responses"][0].tolist() == [25, 26, 27, 28]
    assert [len(part) for part in batch.split(2)] == [2, 1]
    assert batch.split(2)[1].uid.tolist() == ["b"]


def test_batch_to_dataproto() -> None:
    pytest.importorskip("verl")
    batch = TrainingBatch.from_triplets(three_triplets(), pad_token_id=0, max_prompt_length=3, max_response_length=4)
    proto = batch.to_dataproto()
    assert torch.equal(proto.batch["input_ids"], batch["input_ids"])
    assert proto.non_tensor_batch["uid"].tolist() == ["a", "a", "b"]


def test_advantages_match_verl() -> None:
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    config = SimpleNamespace(gamma=1.0, get=lambda key, default=None: default)
    verl_grpo, _ = core_algos.compute_grpo_outcome_advantage(SCORES.clone(), MASK.float(), UID)
    assert_close(grpo_advantages(SCORES, MASK.float(), UID), verl_grpo.tolist(), atol=1e-6)
    verl_rloo, _ = core_algos.compute_rloo_outcome_advantage(SCORES.clone(), MASK.float(), UID, config=config)
    assert_close(rloo_advantages(SCORES, MASK.float(), UID), verl_rloo.tolist(), atol=1e-6)
    verl_rpp, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(SCORES.clone(), MASK.float(), config=config)
    assert_close(reinforce_pp_advantages(SCORES, MASK.float()), verl_rpp.tolist(), atol=1e-6)
    verl_rppb, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        SCORES.clone(), MASK.float(), UID, config=config
    )
    assert_close(reinforce_pp_baseline_advantages(SCORES, MASK.float(), UID), verl_rppb.tolist(), atol=1e-6)
    for kind in ("k1", "low_var_kl"):
        assert_close(kl_penalty(NEW, OLD, kind), core_algos.kl_penalty(NEW, OLD, kind).tolist(), atol=1e-6)


# --- the trainer on the tiny model ------------------------------------------------------------


def tiny_batch(seed: int, rows: int = 4) -> TrainingBatch:
    """Rows of different prompt and response lengths, two groups, one tool-output token masked out."""
    generator = torch.Generator().manual_seed(seed)
    triplets = []
    for row in range(rows):
        prompt = torch.randint(0, 380, (2 + row % 3,), generator=generator).tolist()
        response = torch.randint(0, 380, (2 + (row * 2) % 5,), generator=generator).tolist()
        mask = [1] * len(response)
        mask[1] = 0
        reward = float(torch.rand(1, generator=generator))
        triplets.append(
            Triplet(prompt=prompt, response=response, response_mask=mask, reward=reward, metadata={"group_id": row % 2})
        )
    return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_trainer_step_changes_weights_with_finite_metrics(tiny_dir: Path) -> None:
    config = TrainerConfig(lr=1e-3, micro_batch_size=2, use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01)
    trainer = TorchTrainer(tiny_dir, config, device="cpu")
    assert trainer.tokenizer is not None and trainer.reference is not None
    before = weights(trainer)
    metrics = trainer.step(tiny_batch(0))
    metrics.update(trainer.step(tiny_batch(1)))
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    expected = {"loss", "pg_loss", "kl", "kl_loss", "clip_frac", "approx_kl", "dual_clip_frac", "entropy", "grad_norm"}
    expected |= {"lr", "reward_mean", "reward_std", "adv_mean", "adv_std", "adv_min", "adv_max"}
    expected |= {"zero_std_group_fraction", "response_length_mean", "tokens_per_s", "step_time_s"}
    assert expected <= metrics.keys()
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["kl"] > 0  # the second step starts away from the reference


def test_rl_after_a_warm_start_is_anchored_to_the_warm_started_policy(tiny_dir: Path) -> None:
    """The KL reference was the model as first loaded: after a warm start, RL was pulled back to the untrained
    weights. `start_rl` takes it from the policy as it is, so RL's first step has no KL."""
    config = TrainerConfig(lr=1e-3, micro_batch_size=2, use_kl_loss=True, kl_coef=0.1)
    trainer = TorchTrainer(tiny_dir, config, device="cpu")
    for _ in range(3):
        trainer.sft_step(tiny_batch(0), lr=1e-2)
    batch = tiny_batch(1)
    assert not torch.allclose(trainer.reference_log_probs(batch), trainer.log_probs(trainer.model, batch))
    trainer.start_rl()
    assert torch.equal(trainer.reference_log_probs(batch), trainer.log_probs(trainer.model, batch))
    assert trainer.step(batch)["kl"] == 0.0


def test_trainer_first_pass_is_on_policy(tiny_dir: Path) -> None:
    metrics = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3), device="cpu").step(tiny_batch(0))
    assert metrics["approx_kl"] == 0.0 and metrics["clip_frac"] == 0.0
    # ratio 1 on every token: the policy loss is minus the token-mean advantage.
    assert metrics["pg_loss"] == pytest.approx(-metrics["adv_mean"], abs=1e-6)


def test_trainer_takes_old_log_probs_from_the_sampler_when_asked_and_the_batch_has_them(tiny_dir: Path) -> None:
    batch = tiny_batch(0)
    batch = batch.with_tensors({"rollout_log_probs": torch.full(batch["responses"].shape, -1.0)})
    sampler = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3, old_log_probs="sampler"), device="cpu").step(batch)
    assert sampler["approx_kl"] != 0.0  # the random tiny model's log-probs are far from -1
    trainer = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3), device="cpu").step(batch)
    assert trainer["approx_kl"] == 0.0  # the default: its own, so the first pass is on-policy


def test_the_mismatch_is_the_sampler_s_log_probs_against_the_trainer_s_on_response_tokens(tiny_dir: Path) -> None:
    trainer = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3, mismatch_threshold=0.05), device="cpu")
    batch = tiny_batch(0)
    own = trainer.log_probs(trainer.model, batch.to(trainer.device))
    mask = batch["response_mask"].bool()
    nudged = own.clone()
    nudged[0, 0] += 0.1  # one response token off by 0.1 (row 0's first token is a response token)
    assert mask[0, 0]
    metrics = trainer.step(batch.with_tensors({"rollout_log_probs": torch.where(mask, nudged, torch.zeros_like(own))}))
    assert metrics["mismatch_max"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["mismatch_mean"] == pytest.approx(0.1 / int(mask.sum()), abs=1e-6)
    assert metrics["mismatch_frac"] == pytest.approx(1 / int(mask.sum()))
    assert "mismatch_max" not in TorchTrainer(tiny_dir, TrainerConfig(lr=1e-3), device="cpu").step(tiny_batch(0))


def test_trainer_with_zero_lr_leaves_weights_unchanged(tiny_dir: Path) -> None:
    trainer = TorchTrainer(tiny_dir, TrainerConfig(lr=0.0, micro_batch_size=2), device="cpu")
    before = weights(trainer)
    trainer.step(tiny_batch(0))
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_does_not_change_the_update(tiny_dir: Path, loss_agg: str) -> None:
    # Compared at the gradient AdamW receives: Adam's first step is lr * g / (|g| + eps), which turns a
    # float rounding difference in a near-zero gradient into a visible weight difference.
    results = []
    for micro_batch_size in (1, 4):
        config = TrainerConfig(lr=1e-4, micro_batch_size=micro_batch_size, loss_agg=loss_agg)
        trainer = TorchTrainer(tiny_dir, config, device="cpu")
        gradients: dict[str, torch.Tensor] = {}
        model = trainer.model
        trainer.optimizer.register_step_pre_hook(
            lambda *_, model=model, gradients=gradients: gradients.update(
                {name: p.grad.clone() for name, p in model.named_parameters()}
            )
        )
        metrics = trainer.step(tiny_batch(0))
        results.append((gradients, weights(trainer), metrics))
    (grads_one, weights_one, metrics_one), (grads_four, weights_four, metrics_four) = results
    for name in grads_one:
        torch.testing.assert_close(grads_one[name], grads_four[name], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(weights_one[name], weights_four[name], atol=1e-5, rtol=0)  # a tenth of lr
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("advantage", ["grpo_no_std", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_trainer_runs_every_advantage(tiny_dir: Path, advantage: str) -> None:
    config = TrainerConfig(lr=1e-3, advantage=advantage, kl_in_reward=True, kl_kind="k1", mini_batch_size=2)
    metrics = TorchTrainer(tiny_dir, config, device="cpu").step(tiny_batch(0))
    assert all(math.isfinite(value) for value in metrics.values()), metrics


def test_resume_from_state_dict_is_bit_exact(tiny_dir: Path, tmp_path: Path) -> None:
    config = TrainerConfig(
        lr=1e-3,
        warmup_steps=1,
        lr_schedule="cosine",
        total_steps=5,
        micro_batch_size=2,
        mini_batch_size=2,
        ppo_epochs=2,
    )
    first = TorchTrainer(tiny_dir, config, device="cpu")
    first.step(tiny_batch(0))
    first.step(tiny_batch(1))
    first.model.save_pretrained(tmp_path / "checkpoint")
    first.tokenizer.save_pretrained(tmp_path / "checkpoint")
    torch.save(first.state_dict(), tmp_path / "trainer_state.pt")
    rng = capture_rng_state()
    third = first.step(tiny_batch(2))

    resumed = TorchTrainer(tmp_path / "checkpoint", config, device="cpu")
    resumed.load_state_dict(torch.load(tmp_path / "trainer_state.pt", weights_only=True))
    restore_rng_state(rng)
    assert resumed.step_count == 2
    resumed_third = resumed.step(tiny_batch(2))
    assert resumed_third["lr"] == third["lr"]
    assert resumed_third["loss"] == third["loss"]
    for name, p in first.model.named_parameters():
        assert torch.equal(p, dict(resumed.model.named_parameters())[name]), name


def test_resume_through_a_saved_checkpoint_is_bit_exact(tiny_dir: Path, tmp_path: Path) -> None:
    """The product's path: lightning.checkpoint writes model + trainer state; a new process's trainer
    loaded from it takes exactly the update the uninterrupted run takes."""
    from lightning.checkpoint import latest_checkpoint, load_checkpoint, resume_trainer, save_checkpoint

    config = TrainerConfig(lr=1e-3, warmup_steps=1, lr_schedule="cosine", total_steps=5, micro_batch_size=2)
    first = TorchTrainer(tiny_dir, config, device="cpu")
    first.step(tiny_batch(0))
    save_checkpoint(tmp_path / "ckpt", 1, first.model, first.tokenizer, trainer_state=first.state_dict())
    expected = first.step(tiny_batch(1))

    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    resumed = TorchTrainer(checkpoint.model_dir, config, device="cpu")
    resume_trainer(resumed, checkpoint)
    assert resumed.step(tiny_batch(1))["loss"] == expected["loss"]
    resumed_parameters = dict(resumed.model.named_parameters())
    for name, p in first.model.named_parameters():
        assert torch.equal(p, resumed_parameters[name]), name


def test_a_trainer_with_a_cosine_schedule_needs_its_length(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"algorithm.total_steps"):
        TorchTrainer(tiny_dir, TrainerConfig(lr_schedule="cosine"))
