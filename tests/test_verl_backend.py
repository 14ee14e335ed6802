"""The verl backend's CPU-side contract: our config composes into verl 0.9.1's, our TrainingBatch goes through verl's
DataProto, padding utilities, compute_advantage and actor loss, and every number agrees with the torch trainer on the
same batch and the same tiny model. (The worker group itself needs GPUs: tests/test_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl's CPU modules: make venv installs them")

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from lightning.algorithm.batch import TrainingBatch  # noqa: E402
from lightning.algorithm.losses import entropy_from_logits, token_log_probs  # noqa: E402
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig, loss_normalizers  # noqa: E402
from lightning.algorithm.verl_backend import (  # noqa: E402
    VerlOptions,
    batch_to_dataproto,
    driver_advantages,
    our_metrics,
    verl_config,
    verl_overrides,
)
from lightning.types import Triplet  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, as tiny_dir


def grouped_batch(seed: int = 0, rows: int = 6) -> TrainingBatch:
    """Rows of different prompt and response lengths in two groups of three, one tool-output token masked out."""
    generator = torch.Generator().manual_seed(seed)
    triplets = []
    for row in range(rows):
        prompt = torch.randint(1, 380, (2 + row % 3,), generator=generator).tolist()
        response = torch.randint(1, 380, (2 + (row * 2) % 5,), generator=generator).tolist()
        mask = [1] * len(response)
        mask[1] = 0
        reward = float(torch.rand(1, generator=generator))
        triplets.append(
            Triplet(prompt=prompt, response=response, response_mask=mask, reward=reward, metadata={"group_id": row % 2})
        )
    return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def compose(config: TrainerConfig, model_dir: Path | str = "/models/policy", rows: int = 6, **options):
    return verl_config(model_dir, config, VerlOptions(**options), rows_per_step=rows, total_steps=10)


# --- the configuration --------------------------------------------------------------------------------------------


def test_our_hyperparameters_land_in_verls_config() -> None:
    config = TrainerConfig(
        lr=3e-6, betas=(0.9, 0.95), weight_decay=0.0, warmup_steps=5, clip_low=0.2, clip_high=0.28, dual_clip_c=4.0,
        advantage="rloo", use_kl_loss=True, kl_coef=0.05, kl_kind="k1", loss_agg="seq-mean-token-mean",
        micro_batch_size=2, ppo_epochs=2, max_grad_norm=0.5, entropy_coef=0.01, seed=7,
    )  # fmt: skip
    verl = compose(config, n_gpus_per_node=2, param_offload=True)
    actor = verl.actor_rollout_ref.actor
    assert actor.optim.lr == 3e-6 and list(actor.optim.betas) == [0.9, 0.95] and actor.optim.weight_decay == 0.0
    assert actor.optim.lr_warmup_steps == 5 and actor.optim.total_training_steps == 10
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 4.0)
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.05 and actor.kl_loss_type == "k1"
    assert actor.loss_agg_mode == "seq-mean-token-mean" and actor.ppo_epochs == 2 and actor.grad_clip == 0.5
    assert actor.ppo_micro_batch_size_per_gpu == 2 and actor.ppo_mini_batch_size == 6 and actor.entropy_coeff == 0.01
    assert actor.fsdp_config.param_offload and actor.data_loader_seed == 7
    assert verl.algorithm.adv_estimator == "rloo" and not verl.algorithm.use_kl_in_reward
    assert verl.trainer.n_gpus_per_node == 2 and verl.trainer.use_v1 is False
    assert verl.actor_rollout_ref.model.path == "/models/policy"
    assert "hf_model" in actor.checkpoint.save_contents
    # verl's own dataclass validation accepts the result.
    assert omega_conf_to_dataclass(actor).clip_ratio_c == 4.0


def test_kl_in_reward_and_grpo_without_std() -> None:
    verl = compose(TrainerConfig(advantage="grpo_no_std", kl_in_reward=True, kl_coef=0.2))
    assert verl.algorithm.adv_estimator == "grpo" and verl.algorithm.norm_adv_by_std_in_grpo is False
    assert verl.algorithm.use_kl_in_reward and verl.algorithm.kl_ctrl.kl_coef == 0.2
    assert verl.algorithm.kl_penalty == "low_var_kl" and verl.algorithm.kl_ctrl.type == "fixed"


def test_raw_overrides_come_last() -> None:
    verl = compose(TrainerConfig(lr=1e-6), overrides=["actor_rollout_ref.actor.optim.lr=2e-6"])
    assert verl.actor_rollout_ref.actor.optim.lr == 2e-6


def test_what_verl_cannot_express_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="algorithm.adv_eps"):
        verl_overrides("m", TrainerConfig(adv_eps=1e-4), VerlOptions(), rows_per_step=8, total_steps=1)
    with pytest.raises(ValueError, match="algorithm.mini_batch_size.*multiple of 4"):
        verl_overrides("m", TrainerConfig(), VerlOptions(n_gpus_per_node=4), rows_per_step=6, total_steps=1)


# --- the batch through verl's own functions -----------------------------------------------------------------------


def unpadded_outputs(model: torch.nn.Module, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's engine computes in its no-padding layout, here with the HF model on each packed sequence:
    per token, the log-prob of the *next* token and the entropy, flattened over the batch (total_nnz,)."""
    log_probs, entropies = [], []
    for ids, positions in zip(packed["input_ids"].unbind(), packed["position_ids"].unbind(), strict=True):
        logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
        log_probs.append(token_log_probs(logits, torch.roll(ids, -1)))
        entropies.append(entropy_from_logits(logits))
    return torch.cat(log_probs), torch.cat(entropies)


def test_our_padded_layout_gives_verls_unpadded_log_probs(tiny_dir: Path) -> None:
    """left_right_2_no_padding on our batch, then no_padding_2_padding on per-token outputs, lands every response
    token's log-prob where the torch trainer's padded forward puts it."""
    batch = grouped_batch()
    trainer = TorchTrainer(tiny_dir, TrainerConfig(micro_batch_size=6), device="cpu")
    packed = left_right_2_no_padding(batch_to_dataproto(batch).to_tensordict())
    assert (
        packed["input_ids"].is_nested
        and tu.get_non_tensor_data(packed, "max_response_len", -1) == batch["responses"].shape[1]
    )
    with torch.no_grad():
        flat_log_probs, _ = unpadded_outputs(trainer.model, packed)
        ours = trainer.log_probs(trainer.model, batch)
    theirs = no_padding_2_padding(flat_log_probs, packed)
    real = batch["attention_mask"][:, batch.prompt_length :].bool()
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        TrainerConfig(advantage="grpo"),
        TrainerConfig(advantage="grpo_no_std", use_kl_loss=True),
        TrainerConfig(advantage="rloo", kl_in_reward=True, kl_coef=0.3),
        TrainerConfig(advantage="reinforce_pp", kl_in_reward=True, kl_kind="k1", kl_coef=0.1),
        TrainerConfig(advantage="reinforce_pp_baseline"),
    ],
    ids=["grpo", "grpo_no_std+kl_loss", "rloo+kl_in_reward", "reinforce_pp+k1_in_reward", "reinforce_pp_baseline"],
)
def test_advantages_agree_with_verls_compute_advantage(tiny_dir: Path, config: TrainerConfig) -> None:
    batch = grouped_batch(seed=1)
    trainer = TorchTrainer(tiny_dir, config.model_copy(update={"lr": 1e-2, "micro_batch_size": 6}), device="cpu")
    trainer.step(grouped_batch(seed=2))  # move the policy off its reference, so the KL terms are not zero
    prepared, _ = trainer.prepare(batch)

    proto = batch_to_dataproto(batch)
    proto.batch["old_log_probs"] = prepared["old_log_probs"]
    if "ref_log_prob" in prepared:
        proto.batch["ref_log_prob"] = prepared["ref_log_prob"]
    verl = compose(config)
    proto, _ = driver_advantages(proto, config, verl.algorithm)
    torch.testing.assert_close(proto.batch["token_level_rewards"], prepared["token_level_rewards"])
    torch.testing.assert_close(proto.batch["advantages"], prepared["advantages"], atol=1e-5, rtol=1e-5)


def test_failed_groups_get_the_same_advantage_on_verls_driver(tiny_dir: Path) -> None:
    batch = grouped_batch(seed=1)
    scores = batch["token_level_scores"].clone()
    scores[0::2] = 0.0  # group 0 (rows 0, 2, 4) failed alike
    batch = batch.with_tensors({"token_level_scores": scores})
    config = TrainerConfig(advantage="grpo", kl_in_reward=True, kl_coef=0.3, failed_group_advantage=-1.0)
    trainer = TorchTrainer(tiny_dir, config.model_copy(update={"micro_batch_size": 6}), device="cpu")
    prepared, _ = trainer.prepare(batch)
    proto = batch_to_dataproto(batch)
    proto.batch["old_log_probs"] = prepared["old_log_probs"]
    proto.batch["ref_log_prob"] = prepared["ref_log_prob"]
    proto, _ = driver_advantages(proto, config, compose(config).algorithm)
    torch.testing.assert_close(proto.batch["advantages"], prepared["advantages"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prepared["advantages"][0::2], -batch["response_mask"][0::2].float())


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_actor_loss_agrees_with_verls_ppo_loss(tiny_dir: Path, loss_agg: str) -> None:
    """verl's ppo_loss (what its FSDP actor minimises), fed the tiny model's unpadded outputs, equals the torch
    trainer's loss on the same batch: clipped surrogate, entropy bonus and KL loss, aggregated the same way."""
    config = TrainerConfig(
        lr=1e-2, micro_batch_size=6, use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, clip_high=0.28,
        loss_agg=loss_agg,
    )  # fmt: skip
    trainer = TorchTrainer(tiny_dir, config, device="cpu")
    trainer.step(grouped_batch(seed=3))
    old_batch, _ = trainer.prepare(grouped_batch(seed=4))
    trainer.step(grouped_batch(seed=5))  # the current policy moves away from old_log_probs: ratios != 1
    batch = old_batch
    with torch.no_grad():
        ours, _, _ = trainer.micro_loss(batch, loss_normalizers(batch["response_mask"]))

    proto = batch_to_dataproto(batch)
    for key in ("old_log_probs", "ref_log_prob", "advantages"):
        proto.batch[key] = batch[key]
    packed = left_right_2_no_padding(proto.to_tensordict())
    mask = batch["response_mask"]
    tu.assign_non_tensor(
        packed, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum())
    )
    with torch.no_grad():
        log_probs, entropy = unpadded_outputs(trainer.model, packed)
    actor = omega_conf_to_dataclass(compose(config).actor_rollout_ref.actor)
    theirs, metrics = ppo_loss(actor, {"log_probs": log_probs, "entropy": entropy}, packed)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "kl_loss"} <= metrics.keys()


def test_verl_metrics_under_our_names() -> None:
    metrics = our_metrics({"actor/pg_loss": [0.5, 1.5], "actor/grad_norm": 2.0, "perf/mfu/actor": 0.3, "x": "text"})
    assert metrics == {"pg_loss": 1.0, "grad_norm": 2.0, "perf/mfu/actor": 0.3}
