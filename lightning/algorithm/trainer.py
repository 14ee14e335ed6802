"""The torch trainer: one PPO/GRPO update of a Hugging Face causal LM from a TrainingBatch, resumable bit-exact.

One `step(batch)` is verl's actor update for one training batch, on one device:

    old_log_probs   from the current policy (no grad); the sampler's if old_log_probs="sampler" and the batch has them;
                    when the batch is used once (one epoch, one mini-batch), the update's own forward, detached
    mismatch        |sampler's - trainer's log-prob| on the sampled tokens, when the batch has the sampler's
    off-policy      with off_policy_correction, each token's loss weighed by pi_old / pi_behav (the trainer's old
                    log-probs over the sampler's; capped at tis_cap for "tis")
    ref_log_prob    from a frozen copy of the initial policy, when KL is used (with LoRA: the policy with its
                    adapters switched off, the base model itself)
    advantages      from token_level_scores (minus kl_coef * KL first, with kl_in_reward)
    ppo_epochs x mini-batches: micro-batches accumulate gradients, then clip_grad_norm and one AdamW step
    the LR scheduler steps once per `step`

AdamW is torch's fused kernel on CUDA. The lean forward (`lightning.algorithm.packing`), token-budget micro-batches,
gradient checkpointing, bf16 weights with float32 master weights and LoRA adapters (peft: only the adapters train
and hold optimizer state) are options of TrainerConfig.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.algorithm.advantages import (
    failed_group_advantages,
    grpo_advantages,
    kl_penalized_scores,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_scores,
    zero_std_group_fraction,
)
from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.config import LoraConfig, TrainerConfig
from lightning.algorithm.losses import (
    aggregate,
    behaviour_weights,
    clipped_policy_loss,
    entropy_from_logits,
    importance_metrics,
    kl_penalty,
    masked_mean,
    token_log_probs,
)
from lightning.algorithm.packing import check_hidden_state_path, hidden_state_log_probs, use_varlen_attention
from lightning.devices import resolve_device
from lightning.models.files import no_progress_bars


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    schedule: Literal["constant", "cosine"],
    total_steps: int | None,
    min_lr_ratio: float,
) -> float:
    """LR / peak LR at `step`: linear warmup from 0 (step / warmup_steps, as HF and verl), then constant or
    cosine from 1 down to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    assert total_steps is not None
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def compute_advantages(
    config: TrainerConfig, rewards: torch.Tensor, response_mask: torch.Tensor, uid: Any
) -> torch.Tensor:
    """The advantage estimator the config names."""
    if config.advantage == "grpo":
        return grpo_advantages(rewards, response_mask, uid, norm_by_std=True, eps=config.adv_eps)
    if config.advantage == "grpo_no_std":
        return grpo_advantages(rewards, response_mask, uid, norm_by_std=False, eps=config.adv_eps)
    if config.advantage == "rloo":
        return rloo_advantages(rewards, response_mask, uid)
    if config.advantage == "reinforce_pp":
        return reinforce_pp_advantages(rewards, response_mask, gamma=config.gamma)
    if config.advantage == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, response_mask, uid)
    raise ValueError(f"unknown advantage {config.advantage!r}")


def loss_normalizers(response_mask: torch.Tensor, loss_scale_factor: int | None = None) -> dict[str, Any]:
    """A mini-batch's token and sequence counts (and seq-mean-token-sum-norm's constant): dividing every
    micro-batch's loss by them makes the accumulated gradient the mini-batch's gradient, whatever the micro-batch
    size."""
    return {
        "batch_num_tokens": response_mask.sum(),
        "batch_num_seqs": (response_mask.sum(dim=-1) > 0).sum(),
        "loss_scale_factor": loss_scale_factor or response_mask.shape[-1],
    }


class TorchTrainer:
    """PPO-family updates of a causal LM on one device. `model` and `tokenizer` are the policy's."""

    def __init__(
        self,
        model_dir_or_model: str | Path | torch.nn.Module,
        config: TrainerConfig | None = None,
        device: str | torch.device | None = None,
        reference: str | Path | torch.nn.Module | None = None,
        adapter: str | Path | None = None,
    ) -> None:
        """`reference`: the KL anchor, by default a frozen copy of the policy as loaded. When resuming from a
        checkpoint, pass the initial model here, or the KL term will anchor to the checkpoint instead.

        With `config.lora`, `model_dir_or_model` is the base model, which stays frozen; `adapter`, an adapter
        directory (a LoRA checkpoint) to continue from. The KL anchor is the base: no `reference` is taken."""
        self.config = config or TrainerConfig()
        self.device = torch.device(device) if device else resolve_device(self.config.device, "algorithm.device")
        seed_everything(self.config.seed)
        self.model, self.tokenizer = load_policy(model_dir_or_model)
        self.dtype = torch.bfloat16 if self.config.bf16_weights else torch.float32
        if self.config.lora is not None:
            if reference is not None:
                raise ValueError("lora: the KL reference is the base model with the adapters off; pass no reference")
            base_dir = None if isinstance(model_dir_or_model, torch.nn.Module) else Path(model_dir_or_model)
            self.model = add_lora(self.model, self.config.lora, base_dir)
            if adapter is not None:
                load_adapter_weights(self.model, adapter)
        elif adapter is not None:
            raise ValueError("an adapter to continue from needs algorithm.lora")
        # Eval mode all along: with dropout off the first PPO pass sees ratio == 1 exactly.
        self.model.to(self.device, self.dtype).eval()
        self.reference = None
        if self.config.uses_reference and self.config.lora is None:
            anchor = self.model if reference is None else load_policy(reference)[0]
            self.reference = frozen_copy(anchor).to(self.device, self.dtype)
        for model in filter(None, (self.model, self.reference)):
            if self.config.pack_sequences or self.config.logit_chunk_tokens:
                check_hidden_state_path(model)
            if self.config.pack_sequences:
                use_varlen_attention(model)
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(self.base_model)
        self.master_weights = MasterWeights(self.model) if self.config.bf16_weights else None
        self.reset_optimizer()

    def start_rl(self) -> None:
        """RL starts here, after a supervised warm start: a fresh optimizer (`reset_optimizer`) and, with KL, the
        reference re-taken from the policy as it is now, as verl's reference is the fine-tuned model (it was the
        model as first loaded: the warm start's random or base weights, and a resumed run, loading the warm start's
        checkpoint, anchored elsewhere). With LoRA the reference stays the base model (the adapters off)."""
        self.reset_optimizer()
        if self.reference is not None:
            self.reference = frozen_copy(self.model).to(self.device, self.dtype)

    def reset_optimizer(self) -> None:
        """A fresh AdamW (no moments) and LR schedule from step 0: what RL starts with after a supervised warm
        start, whose steps neither shape the RL optimizer's moments nor use up its warm-up or cosine schedule."""
        if self.config.lr_schedule == "cosine" and self.config.total_steps is None:
            raise ValueError("algorithm.lr_schedule 'cosine' needs algorithm.total_steps: the schedule's length")
        self.optimizer = torch.optim.AdamW(
            self.trained_parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
            fused=self.device.type == "cuda" or None,  # None: torch's default (foreach)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(
                lr_multiplier,
                warmup_steps=self.config.warmup_steps,
                schedule=self.config.lr_schedule,
                total_steps=self.config.total_steps,
                min_lr_ratio=self.config.min_lr_ratio,
            ),
        )
        self.step_count = 0

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What AdamW updates: the model's trainable parameters (all, or the LoRA adapters), or their float32 master
        copies with bf16_weights."""
        if self.master_weights:
            return self.master_weights.params
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def base_model(self) -> torch.nn.Module:
        """The transformers model: the policy itself, or the base model inside the LoRA wrapper (adapters included)."""
        return self.model.get_base_model() if self.config.lora is not None else self.model

    def micro_batches(self, batch: TrainingBatch) -> list[TrainingBatch]:
        """micro_batch_tokens' token budget, or micro_batch_size rows."""
        if self.config.micro_batch_tokens:
            return batch.split_by_tokens(self.config.micro_batch_tokens)
        return batch.split(self.config.micro_batch_size)

    def single_pass(self, batch: TrainingBatch) -> bool:
        """Every row is used once, by the update's one optimizer step (one epoch over one mini-batch), and no KL sits in
        the reward (which needs the old log-probs before the advantages). The update's own forward then runs on the
        weights the old log-probs would come from, so it gives them, detached: the no-grad forward before it would
        compute the same numbers (TRL skips it in this case too)."""
        config = self.config
        one_mini_batch = config.mini_batch_size is None or config.mini_batch_size >= len(batch)
        return config.ppo_epochs == 1 and one_mini_batch and not config.kl_in_reward

    @property
    def importance_cap(self) -> float | None:
        """The cap on the off-policy weight pi_old / pi_behav: tis_cap for TIS, none for decoupled PPO."""
        return self.config.tis_cap if self.config.off_policy_correction == "tis" else None

    # --- one training step --------------------------------------------------------------------

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """One update from one batch; returns its metrics."""
        if len(batch) == 0:
            raise ValueError("cannot train on an empty batch")
        start = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        batch = batch.to(self.device)
        single_pass = self.single_pass(batch)
        batch, prepare_metrics = self.prepare(batch, old_from_update=single_pass)
        update_metrics = self.update(batch, old_from_update=single_pass)
        self.scheduler.step()
        self.step_count += 1
        step_time = time.perf_counter() - start
        return {
            **update_metrics,
            **prepare_metrics,
            **batch_metrics(batch),
            "lr": lr,
            "step": float(self.step_count),
            "step_time_s": step_time,
            "tokens_per_s": float(batch["attention_mask"].sum()) / step_time,
        }

    def sft_step(self, batch: TrainingBatch, lr: float | None = None) -> dict[str, float]:
        """One supervised step at `lr` (None: the schedule's): maximise the log-likelihood of the masked response
        tokens (rewards are ignored). A short warm start on a few demonstrations makes sparse rewards reachable;
        `start_rl` after it gives RL a fresh optimizer and its KL reference."""
        batch = batch.to(self.device)
        tokens = batch["response_mask"].sum().clamp(min=1)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.zero_grad()
        total = 0.0
        for micro in self.micro_batches(batch):
            log_probs, _ = self.forward(self.model, micro)
            loss = -(log_probs * micro["response_mask"]).sum() / tokens  # token-mean negative log-likelihood
            loss.backward()
            total += loss.item()
        grad_norm, _ = self.optimizer_step()
        self.scheduler.step()
        self.step_count += 1
        return {"sft_loss": total, "grad_norm": float(grad_norm), "step": float(self.step_count)}

    def prepare(self, batch: TrainingBatch, old_from_update: bool = False) -> tuple[TrainingBatch, dict[str, float]]:
        """Add old_log_probs, ref_log_prob (with KL), token_level_rewards and advantages to the batch. With
        `old_from_update` (a `single_pass` batch) the trainer's old log-probs, and the metrics drawn from them, are
        left to the update's forward."""
        config = self.config
        mask = batch["response_mask"].float()
        extra: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        sampled = batch["rollout_log_probs"].float() if "rollout_log_probs" in batch else None
        if sampled is not None and config.old_log_probs == "sampler":
            extra["old_log_probs"] = sampled
        elif not old_from_update:
            extra["old_log_probs"] = self.log_probs(self.model, batch)
        if config.uses_reference:
            extra["ref_log_prob"] = self.reference_log_probs(batch)
        if not old_from_update:
            ours = extra["old_log_probs"] if sampled is None or config.old_log_probs == "trainer" else None
            ours = self.log_probs(self.model, batch) if ours is None else ours
            metrics = self.old_policy_metrics(batch.with_tensors(extra), extra["old_log_probs"], ours)
        rewards = batch["token_level_scores"]
        if config.kl_in_reward:  # never with old_from_update: the rewards need the old log-probs now
            rewards = kl_penalized_scores(
                rewards, extra["old_log_probs"], extra["ref_log_prob"], mask, config.kl_coef, config.kl_kind
            )
        extra["token_level_rewards"] = rewards
        extra["advantages"] = compute_advantages(config, rewards, mask, batch.uid)
        if config.failed_group_advantage:
            extra["advantages"] = failed_group_advantages(
                extra["advantages"], batch["token_level_scores"], mask, batch.uid, config.failed_group_advantage
            )
        return batch.with_tensors(extra), metrics

    def old_policy_metrics(self, batch: TrainingBatch, old: torch.Tensor, ours: torch.Tensor) -> dict[str, float]:
        """`kl` of the old policy (the ratio's denominator, `old`) to the reference, when there is one; the mismatch of
        the sampler's log-probs against `ours` (the trainer's before the update), when the batch has the sampler's."""
        mask = batch["response_mask"].float()
        metrics: dict[str, float] = {}
        if "rollout_log_probs" in batch:  # the engine's log-probs against ours, on the same weights
            sampled = batch["rollout_log_probs"].float()
            metrics.update(mismatch_metrics(sampled, ours, mask, self.config.mismatch_threshold))
            if self.config.off_policy_correction != "none":
                metrics.update(importance_metrics(ours, sampled, mask, self.importance_cap))
        if "ref_log_prob" in batch:
            old_kl = kl_penalty(old, batch["ref_log_prob"], self.config.kl_kind)
            metrics["kl"] = float(aggregate(old_kl, mask, self.config.loss_agg))
        return metrics

    def reference_log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        """[B, R] log-probs under the KL reference: its frozen copy, or with LoRA the policy with its adapters off."""
        if self.reference is not None:
            return self.log_probs(self.reference, batch)
        with self.model.disable_adapter():
            return self.log_probs(self.model, batch)

    @torch.no_grad()
    def log_probs(self, model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under `model`, micro-batch by micro-batch."""
        chunks = [self.forward(model, micro)[0] for micro in self.micro_batches(batch)]
        return torch.cat(chunks, dim=0)

    def forward(self, model: torch.nn.Module, batch: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] response-token log-probs and entropies (entropy carries gradient only if entropy_coef). With
        pack_sequences or logit_chunk_tokens, the lean forward: 0 on padding, the rest equal within float rounding."""
        if batch.prompt_length == 0:
            raise ValueError("every row needs at least one prompt token to predict its first response token from")
        config = self.config
        response_length = batch["responses"].shape[1]
        autocast = config.bf16 and self.device.type == "cuda"
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=autocast):
            if config.pack_sequences or config.logit_chunk_tokens:
                return hidden_state_log_probs(
                    model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"],
                    pack=config.pack_sequences, chunk_tokens=config.logit_chunk_tokens,
                    entropy_grad=bool(config.entropy_coef), temperature=config.scoring_temperature,
                )  # fmt: skip
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                use_cache=False,
                logits_to_keep=response_length + 1,
            ).logits
        # The logit at position t predicts token t + 1: the last prompt token predicts the first response token.
        response_logits = logits[:, :-1] / config.scoring_temperature  # the policy that sampled: softmax(z / T)
        log_probs = token_log_probs(response_logits, batch["responses"])
        entropy = entropy_from_logits(response_logits if self.config.entropy_coef else response_logits.detach())
        return log_probs, entropy

    def update(self, batch: TrainingBatch, old_from_update: bool = False) -> dict[str, float]:
        """ppo_epochs passes over mini-batches; one optimizer step per mini-batch. Returns mean metrics. With
        `old_from_update` (a `single_pass` batch), the forward's log-probs are the old ones too."""
        config = self.config
        totals: dict[str, float] = defaultdict(float)
        optimizer_steps = 0
        before_update: list[torch.Tensor] = []
        for _ in range(config.ppo_epochs):
            for mini in batch.split(config.mini_batch_size or len(batch)):
                self.zero_grad()
                normalizers = loss_normalizers(mini["response_mask"], config.loss_scale_factor)
                for micro in self.micro_batches(mini):
                    loss, contributions, log_probs = self.micro_loss(micro, normalizers)
                    loss.backward()
                    for name, value in contributions.items():
                        totals[name] += value
                    if old_from_update:
                        before_update.append(log_probs)
                grad_norm, stepped = self.optimizer_step()
                totals["nonfinite_grad_steps"] += not stepped
                totals["grad_norm"] += grad_norm
                optimizer_steps += 1
        metrics = {name: value / optimizer_steps for name, value in totals.items()}
        metrics["nonfinite_grad_steps"] = totals["nonfinite_grad_steps"]
        if old_from_update:
            ours = torch.cat(before_update)
            metrics.update(self.old_policy_metrics(batch, batch.tensors.get("old_log_probs", ours), ours))
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master_weights:
            self.model.zero_grad(set_to_none=True)

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip the accumulated gradient, take one AdamW step, clear the gradients; the gradient's norm and whether
        the step was taken (as verl: a non-finite gradient skips the step instead of poisoning the weights)."""
        if self.master_weights:
            self.master_weights.take_gradients()
        parameters = self.trained_parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm)
        stepped = bool(torch.isfinite(grad_norm))
        if stepped:
            self.optimizer.step()
            if self.master_weights:
                self.master_weights.copy_to_model()
        self.zero_grad()
        return float(grad_norm), stepped

    def micro_loss(
        self, micro: TrainingBatch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """This micro-batch's share of the mini-batch loss, its share of each metric (shares add up), and its
        log-probs, detached. Without old_log_probs in the batch, those log-probs are the old ones (ratio 1)."""
        config = self.config
        mask = micro["response_mask"].float()
        log_probs, entropy = self.forward(self.model, micro)
        old_log_probs = micro.tensors.get("old_log_probs", log_probs.detach())
        weights = None
        if config.off_policy_correction != "none" and "rollout_log_probs" in micro:
            weights = behaviour_weights(old_log_probs, micro["rollout_log_probs"].float(), self.importance_cap)
        pg_loss, pg_metrics = clipped_policy_loss(
            log_probs,
            old_log_probs,
            micro["advantages"],
            mask,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            dual_clip_c=config.dual_clip_c,
            agg=config.loss_agg,
            **normalizers,
            importance_weights=weights,
        )
        entropy_loss = aggregate(entropy, mask, config.loss_agg, **normalizers)
        loss = pg_loss - config.entropy_coef * entropy_loss
        token_share = mask.sum() / normalizers["batch_num_tokens"].clamp(min=1)
        contributions = {"pg_loss": pg_loss, "entropy": entropy_loss}
        contributions.update({name: value * token_share for name, value in pg_metrics.items()})
        if config.use_kl_loss:
            kl_loss = aggregate(
                kl_penalty(log_probs, micro["ref_log_prob"], config.kl_kind), mask, config.loss_agg, **normalizers
            )
            loss = loss + config.kl_coef * kl_loss
            contributions["kl_loss"] = kl_loss
        contributions["loss"] = loss
        return loss, {name: float(value.detach()) for name, value in contributions.items()}, log_probs.detach()

    # --- checkpoint state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler and step count; `torch.load(weights_only=True)` reads it back. The RNG states are
        the checkpoint's to save (`lightning.checkpoint`), with the weights."""
        state = {
            "step": self.step_count,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.config.model_dump(mode="json"),
        }
        if self.master_weights:  # the checkpoint's weights are their bf16 rounding
            state["master_weights"] = [p.detach().clone() for p in self.master_weights.params]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the optimizer, scheduler and step count. `lightning.checkpoint.resume_trainer` also restores the
        RNG states saved with them: then the next `step` is bit-exact on CPU."""
        if self.master_weights:
            if "master_weights" not in state:
                raise ValueError(
                    "bf16_weights: this trainer state has no float32 master weights (it was saved without "
                    "bf16_weights); resume with bf16_weights false, or start a new run"
                )
            self.master_weights.load(state["master_weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])


# --- helpers ----------------------------------------------------------------------------------


def load_policy(model_dir_or_model: str | Path | torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """A model directory loads in float32 with its tokenizer; a model object comes back as is, no tokenizer."""
    if isinstance(model_dir_or_model, torch.nn.Module):
        return model_dir_or_model, None
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir_or_model)


class MasterWeights:
    """Float32 master copies of a bf16 model's parameters: gradients computed in bf16 are taken over as float32, AdamW
    updates the copies, and the model gets them back rounded to bf16. An update far below a weight's bf16 spacing
    (2^-8 of it) still accumulates in the copy, where the bf16 weight alone would drop it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]

    def take_gradients(self) -> None:
        """The model's bf16 gradients as the master copies' float32 ones (the bf16 ones are let go)."""
        for master, param in zip(self.params, self.model_params, strict=True):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for master, param in zip(self.params, self.model_params, strict=True):
            param.copy_(master)

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.params):
            raise ValueError(f"{len(tensors)} master weights saved for a model of {len(self.params)} parameters")
        for master, saved in zip(self.params, tensors, strict=True):
            master.copy_(saved)
        self.copy_to_model()


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Transformers' activation checkpointing of each decoder layer (non-reentrant). Transformers checkpoints a layer
    only while it is in training mode, and the trainer keeps the model in eval mode (no dropout); so the layers alone
    are flagged as training, not their submodules: dropout stays off, the forward's numbers do not change."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (transformers 5.24 has it, 5.17 not)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no layer transformers can checkpoint")
    for layer in layers:
        layer.training = True


def add_lora(model: torch.nn.Module, lora: LoraConfig, base_dir: Path | None = None) -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters on `lora.target_modules`: the base weights frozen, the adapters
    trainable, B initialised to 0 (the wrapped model computes what `model` does until the first update). The adapter
    config names `base_dir` (absolute) as its base model, so a saved adapter says where its base is."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Embedding

    targets: str | list[str] = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    peft_config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    try:
        wrapped = get_peft_model(model, peft_config)
    except ValueError as exc:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"lora.target_modules: {exc}") from exc
    # The inference servers merge (or vLLM loads) adapters of linear layers: an adapted embedding would not be served.
    embeddings = sorted(
        {name.rsplit(".", 1)[-1] for name, module in wrapped.named_modules() if isinstance(module, Embedding)}
    )
    if embeddings:
        raise ValueError(
            f"lora.target_modules: {embeddings} are embedding layers; the inference servers apply adapters of linear "
            "layers only (the output head, lm_head, is one)"
        )
    if base_dir is not None:
        wrapped.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    return wrapped


def load_adapter_weights(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """Set a LoRA-wrapped model's adapters to those saved in `adapter_dir` (adapter_model.safetensors); every adapter
    weight must be there."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    missing = [name for name in result.missing_keys if "lora_" in name]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"adapter {adapter_dir} does not fit the model's LoRA layout (lora.rank, lora.target_modules): "
            f"missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}"
        )


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def mismatch_metrics(
    sampled: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, threshold: float
) -> dict[str, float]:
    """The train/inference mismatch on the sampled tokens: |log pi_engine(a|s) - log pi_trainer(a|s)|, its mean and
    max over the response tokens, and the share above `threshold`. Near 0 when the engine serves the trainer's
    weights; a reload that silently failed shows as a large value."""
    tokens = mask.bool()
    delta = (sampled - trainer).abs()[tokens]
    if delta.numel() == 0:
        return {}
    return {
        "mismatch_mean": float(delta.mean()),
        "mismatch_max": float(delta.max()),
        "mismatch_frac": float((delta > threshold).float().mean()),
    }


def batch_metrics(batch: TrainingBatch) -> dict[str, float]:
    """What the batch itself says: rewards, advantages, response lengths, flat groups."""
    scores = sequence_scores(batch["token_level_scores"])
    mask = batch["response_mask"].float()
    advantages = batch["advantages"]
    masked_advantages = advantages[mask.bool()]
    adv_mean = masked_mean(advantages, mask)
    response_lengths = batch["attention_mask"][:, batch.prompt_length :].sum(dim=-1).float()
    return {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std(unbiased=False)),
        "adv_mean": float(adv_mean),
        "adv_std": float(masked_mean((advantages - adv_mean) ** 2, mask).sqrt()),
        "adv_min": float(masked_advantages.min()) if masked_advantages.numel() else 0.0,
        "adv_max": float(masked_advantages.max()) if masked_advantages.numel() else 0.0,
        "zero_std_group_fraction": zero_std_group_fraction(batch["token_level_scores"], batch.uid),
        "response_length_mean": float(response_lengths.mean()),
    }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
