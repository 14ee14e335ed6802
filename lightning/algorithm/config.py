"""The algorithm's settings as plain pydantic models, importable without torch: `TrainerConfig` (one PPO/GRPO
update, with its `LoraConfig`) and `VerlOptions` (the verl backend's cluster and memory options). `TrainConfig` holds
both."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning.devices import DeviceSetting

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "low_var_kl"]
AdvantageKind = Literal["grpo", "grpo_no_std", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """LoRA adapters (peft): the base weights stay frozen, only the low-rank matrices A and B of each target module
    train (W + alpha / rank * B @ A), so only they carry gradients and optimizer state; checkpoints hold the adapter
    and the inference servers apply it to the base they already hold."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(default=16, ge=1)
    """r: the inner dimension of each adapter's B @ A."""
    alpha: float = Field(default=32.0, gt=0)
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (the trainer runs in eval mode otherwise: with 0, the first PPO
    pass sees ratio 1 exactly)."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    """Names (last part) of the linear layers that get adapters: by default the attention and MLP projections of
    Llama, Qwen and Mistral models; `all-linear` alone: every linear layer but the output head. Add `lm_head` to adapt
    the output head too (served by the embedded server and vLLM; on the demo it made LoRA learn more surely:
    docs/benchmarks.md). Embedding layers are refused: the servers apply adapters of linear layers only."""


class TrainerConfig(BaseModel):
    """Everything one update depends on; defaults follow verl's actor and algorithm defaults."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(default=1e-6, ge=0)
    """Learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's beta1 and beta2."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW's decoupled weight decay."""
    warmup_steps: int = Field(default=0, ge=0)
    """Updates (`step` calls: one per training iteration, whatever its epochs and mini-batches) of linear warm-up
    from 0 to lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant lr, or cosine decay to min_lr_ratio * lr over total_steps."""
    total_steps: int | None = Field(default=None, ge=1)
    """Length of the cosine schedule, in `step` calls; needed for "cosine" (None in a run's config: its
    `iterations`)."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Where the cosine schedule ends, as a fraction of lr."""

    clip_low: float = Field(default=0.2, ge=0)
    """PPO ratio clip below 1: the ratio is clipped at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """PPO ratio clip above 1: the ratio is clipped at 1 + clip_high (DAPO raises it)."""
    dual_clip_c: float = Field(default=3.0, gt=1)
    """Dual-clip bound: for negative advantages the loss is capped at c * |A|."""

    advantage: AdvantageKind = "grpo"
    """How rewards become advantages: grpo (group mean and std), grpo_no_std, rloo (leave-one-out), reinforce_pp
    (batch-whitened returns), reinforce_pp_baseline (group mean, then whitened)."""
    adv_eps: float = Field(default=1e-6, gt=0)
    """Added to the standard deviation when advantages are divided by it."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount of REINFORCE++'s return-to-go."""
    failed_group_advantage: float = Field(default=0.0, le=0)
    """The advantage of every response in a group whose responses all failed alike (equal scores, at most 0), in
    place of the 0 that group-relative advantages give it: a negative value pushes those answers down, so that the
    policy samples others and a task it never solves can start to give signal (negative sample reinforcement,
    https://arxiv.org/abs/2506.01347); 0: none. With dynamic sampling, such groups reach the update only through the
    run's `keep_failed_groups`."""

    kl_coef: float = Field(default=0.001, ge=0)
    """Weight of the KL penalty to the reference (initial) policy, as the loss term or in the reward."""
    kl_kind: KLKind = "low_var_kl"
    """KL estimator: k1 (log-ratio) or low_var_kl (k3, always >= 0)."""
    use_kl_loss: bool = False
    """Add kl_coef * KL(policy || reference) to the loss (GRPO's way)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL(old policy || reference) from token_level_scores before advantages (PPO's way)."""

    loss_agg: LossAggMode = "token-mean"
    """How token losses average into the batch loss: over all tokens (DAPO's token-level loss), per sequence first
    (GRPO's seq-mean-token-mean), or each sequence's token sum over a constant (seq-mean-token-sum-norm, Dr. GRPO's
    unbiased normalisation: no response length in any denominator, so long and short answers weigh per token alike;
    use it with advantage grpo_no_std)."""
    loss_scale_factor: int | None = Field(default=None, ge=1)
    """seq-mean-token-sum-norm: the constant each sequence's token sum is divided by (Dr. GRPO: the generation
    budget, e.g. the run's max_response_length); None: the batch's padded response length."""
    micro_batch_size: int = Field(default=4, ge=1)
    """Rows per forward/backward; only memory depends on it, not the update."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Micro-batches by a token budget instead of micro_batch_size rows: consecutive rows while their real (prompt +
    response) tokens add up to at most this; a longer row goes alone. Best with pack_sequences (padded rows cost the
    batch's full width each)."""
    mini_batch_size: int | None = Field(default=None, ge=1)
    """Rows per optimizer step; None: the whole batch, one optimizer step per epoch."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the batch per update."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0: none."""
    temperature: float | None = Field(default=None, gt=0)
    """The sampling temperature T the rollouts were drawn at: the trainer's log-probs and entropies are those of
    softmax(logits / T), the policy that sampled (verl's actor does the same). None: the run's
    `sampling.temperature` (1.0 outside a run)."""
    pack_sequences: bool = False
    """Run each micro-batch's rows as one sequence without padding: position ids restart at each row and attention
    stays within it (torch's varlen flash attention on CUDA in bf16/fp16, SDPA row by row otherwise). The same loss
    and gradients as padded rows, without the work on padding."""
    logit_chunk_tokens: int | None = Field(default=None, ge=1)
    """Log-probs and entropies from the last hidden states, this many response tokens at a time, each chunk's logits
    recomputed in the backward pass: the float32 [tokens x vocab] logits never exist whole (None: all at once)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: far less activation memory, about a third
    more compute."""
    device: DeviceSetting = "auto"
    """Where the torch trainer runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N."""
    bf16: bool = True
    """bf16 autocast for forward passes on CUDA; weights and optimizer stay float32. Ignored on CPU."""
    bf16_weights: bool = False
    """Hold the model in bfloat16 while AdamW updates a float32 master copy, cast back after each step: forward and
    backward run in bf16 throughout (no per-op casts of the weights, bf16 activations; gradients accumulate over
    micro-batches in bf16), and updates below bf16's spacing still add up in the master copy. Weights, master copy and
    gradients take about what float32 weights and gradients do. Checkpoints hold the bf16 weights (what the inference
    server serves); the master copy travels in the trainer state."""
    old_log_probs: Literal["trainer", "sampler"] = "trainer"
    """The PPO ratio's denominator: the trainer's own log-probs of the sampled tokens before the update (verl's
    default), or the inference engine's (`sampler`, when every row has them; the trainer's otherwise)."""
    off_policy_correction: Literal["none", "decoupled", "tis"] = "none"
    """Weigh each token's clipped loss by how the policy that sampled it (the behaviour policy: the sampler's
    log-probs the proxy stored) differs from the old one (the trainer's log-probs before the update): `decoupled`,
    decoupled PPO's weight pi_old / pi_behav (https://arxiv.org/abs/2110.00641); `tis`, truncated importance
    sampling's min(pi_old / pi_behav, tis_cap). A batch whose rows do not all have the sampler's log-probs is not
    weighed. Needs old_log_probs "trainer"; what makes samples off-policy is `max_staleness`."""
    tis_cap: float = Field(default=2.0, gt=0)
    """TIS's cap C on the importance weight pi_old / pi_behav."""
    max_staleness: int = Field(default=0, ge=0)
    """Versions of the policy a sample may lag behind the one it trains: 0, the synchronous loop (each iteration's
    rollouts start after the last update was published); k >= 1, iteration i's rollouts start once iteration
    i-1-k is done, so they run while the iterations before them update and checkpoint, and adapt_spans drops the
    rollouts sampled more than k versions before the policy being updated."""
    mismatch_threshold: float = Field(default=0.1, gt=0)
    """A sampled token whose engine and trainer log-probs differ by more than this counts in `mismatch_frac`."""
    seed: int = 0
    """Seeds the trainer (mini-batch order, dropout)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of all the weights (None: full fine-tuning). `lora: {}` takes the defaults. The
    KL reference is then the base model itself (the adapters switched off), not a copy."""

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.use_kl_loss and self.kl_in_reward:
            raise ValueError("use_kl_loss and kl_in_reward both apply the KL penalty; choose one")
        if self.off_policy_correction != "none" and self.old_log_probs == "sampler":
            raise ValueError(
                "off_policy_correction weighs the sampler's log-probs against the trainer's old ones: use "
                "old_log_probs 'trainer' with it"
            )
        return self

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward

    @property
    def scoring_temperature(self) -> float:
        """The T of softmax(logits / T) the trainer scores tokens under: `temperature`, or 1.0 outside a run."""
        return self.temperature or 1.0


class VerlOptions(BaseModel):
    """What verl needs beyond the algorithm's hyperparameters: the cluster shape and FSDP's memory options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    n_gpus_per_node: int = Field(default=1, ge=1)
    """GPUs verl uses on each node."""
    nnodes: int = Field(default=1, ge=1)
    """Nodes of the Ray cluster verl uses."""
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    """verl's sharding of the actor: FSDP or FSDP2."""
    param_offload: bool = False
    """Keep FSDP parameters on the CPU between uses (less GPU memory, slower)."""
    optimizer_offload: bool = False
    """Keep the optimizer state on the CPU between steps (less GPU memory, slower)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (less GPU memory, about a third slower)."""
    use_remove_padding: bool = True
    """Run the model on packed sequences without padding (needs flash-attention on the GPU stack)."""
    ray_namespace: str = "lightning"
    """Ray namespace of the verl workers."""
    overrides: list[str] = Field(default_factory=list)
    """verl hydra overrides applied last, as on verl's command line, e.g.
    `actor_rollout_ref.actor.fsdp_config.fsdp_size=4`."""
    start_timeout: float = Field(default=1800, gt=0)
    """Seconds to bring up the worker group (model load and FSDP wrap on every GPU)."""
