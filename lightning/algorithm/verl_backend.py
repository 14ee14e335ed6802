"""verl 0.9.1 as the backend of the PPO step: our TrainerConfig mapped onto verl's config, verl's FSDP workers on a
Ray cluster kept alive across iterations by one named Ray actor, and a client with the TrainerWorker's interface.

One `step(batch_path)` does what verl's legacy `RayPPOTrainer.fit` does for one batch after generation and reward
(verl/trainer/ppo/ray_trainer.py), on our TrainingBatch, which already carries verl's DataProto keys:

    old_log_probs   actor.compute_log_prob, or the sampler's with old_log_probs="sampler"  (as ours; mismatch too)
    ref_log_prob    ref.compute_ref_log_prob, when the config uses a KL reference
    token_level_rewards, advantages   apply_kl_penalty (kl_in_reward) and compute_advantage, on the driver
    update_actor    ppo_epochs x mini-batches of FSDP updates; returns metrics

Our config -> verl's (see `verl_overrides`; a field verl cannot express is an error naming it):

    lr, betas, weight_decay          actor.optim.{lr, betas, weight_decay}
    warmup_steps, lr_schedule        actor.optim.{lr_warmup_steps, lr_scheduler_type}
    total_steps, min_lr_ratio        actor.optim.{total_training_steps, min_lr_ratio}
    clip_low, clip_high, dual_clip_c actor.{clip_ratio_low, clip_ratio_high, clip_ratio_c}
    advantage                        algorithm.adv_estimator (+ norm_adv_by_std_in_grpo for grpo_no_std)
    gamma                            algorithm.gamma
    use_kl_loss, kl_coef, kl_kind    actor.{use_kl_loss, kl_loss_coef, kl_loss_type}
    kl_in_reward, kl_coef, kl_kind   algorithm.{use_kl_in_reward, kl_ctrl.kl_coef (fixed), kl_penalty}
    loss_agg, loss_scale_factor      actor.{loss_agg_mode, loss_scale_factor}
    micro_batch_size                 actor.ppo_micro_batch_size_per_gpu, rollout/ref log_prob_micro_batch_size_per_gpu
    mini_batch_size, ppo_epochs      the mini-batch of each update_actor call, actor.ppo_epochs
    max_grad_norm, entropy_coef      actor.grad_clip, actor.entropy_coeff
    bf16                             actor.fsdp_config.dtype (bfloat16 or float32 compute)
    seed                             actor.data_loader_seed, actor.fsdp_config.seed
    lora.{rank, alpha, target_modules}  actor_rollout_ref.model.{lora_rank, lora_alpha, target_modules} (verl's LoRA
                                     has no dropout: lora.dropout must be 0); what verl's export holds with LoRA, and
                                     so what a LoRA run on verl publishes, has not been run here (it needs GPUs)
    old_log_probs, mismatch_threshold  on the driver (which log-probs the update uses; the mismatch metrics)
    failed_group_advantage           on the driver, after verl's compute_advantage (verl has no such option)

Weights reach the inference servers as checkpoints: each save writes verl's own checkpoint (model, optimizer, extra)
plus a Hugging Face export, and our `step-*` checkpoint directory is that export, which vLLM reloads. verl's
CheckpointEngineManager (NCCL weight broadcast into rollout replicas that verl itself launches) is not used: our
vLLM servers are launched by us and sit behind the LLM proxy.

Only the client, the config mapping and the driver-side math run without a GPU; everything in `VerlActorGroup`
needs CUDA devices on the Ray cluster. verl is imported inside functions only (it is an optional dependency).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from lightning import raycluster
from lightning.algorithm.config import TrainerConfig, VerlOptions

logger = logging.getLogger(__name__)

ADVANTAGE_ESTIMATORS: dict[str, tuple[str, bool]] = {
    "grpo": ("grpo", True),
    "grpo_no_std": ("grpo", False),
    "rloo": ("rloo", True),
    "reinforce_pp": ("reinforce_plus_plus", True),
    "reinforce_pp_baseline": ("reinforce_plus_plus_baseline", True),
}
"""Our `TrainerConfig.advantage` -> (verl's algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)."""

VERL_GRPO_EPSILON = 1e-6
"""verl's compute_advantage calls compute_grpo_outcome_advantage with its default epsilon."""

VERL_STATE_DIR = "verl"
"""Under the run's checkpoint root: verl's own checkpoints (sharded model, optimizer, extra), one per step."""


# --- the configuration ------------------------------------------------------------------------------------------


def verl_overrides(
    model_dir: str | Path,
    trainer: TrainerConfig,
    options: VerlOptions,
    *,
    rows_per_step: int,
    total_steps: int,
) -> list[str]:
    """verl hydra overrides for our hyperparameters (see the module docstring's table). `rows_per_step`: the rows of a
    training batch (the default mini-batch); `total_steps`: update steps in the run (the LR schedule's length)."""
    if trainer.adv_eps != VERL_GRPO_EPSILON:
        raise ValueError(
            f"algorithm.adv_eps: verl's GRPO fixes epsilon at {VERL_GRPO_EPSILON:g}; leave adv_eps at its default "
            "with the verl backend"
        )
    mini_batch = trainer.mini_batch_size or rows_per_step
    dp_size = options.n_gpus_per_node * options.nnodes
    if mini_batch % dp_size:
        raise ValueError(
            f"algorithm.mini_batch_size: verl splits each mini-batch evenly over the {dp_size} GPUs; {mini_batch} "
            f"rows is not a multiple of {dp_size} (set mini_batch_size, or batch_size x samples_per_task, to one)"
        )
    estimator, norm_by_std = ADVANTAGE_ESTIMATORS[trainer.advantage]
    actor = "actor_rollout_ref.actor"
    micro = trainer.micro_batch_size
    values: dict[str, Any] = {
        "actor_rollout_ref.model.path": str(model_dir),
        "actor_rollout_ref.model.enable_gradient_checkpointing": options.gradient_checkpointing,
        "actor_rollout_ref.model.use_remove_padding": options.use_remove_padding,
        "actor_rollout_ref.rollout.n": 1,  # our batches arrive already grouped; mini-batches count rows
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro,
        f"{actor}.strategy": options.strategy,
        "actor_rollout_ref.ref.strategy": options.strategy,
        f"{actor}.optim.lr": trainer.lr,
        f"{actor}.optim.betas": list(trainer.betas),
        f"{actor}.optim.weight_decay": trainer.weight_decay,
        f"{actor}.optim.lr_warmup_steps": trainer.warmup_steps,
        f"{actor}.optim.lr_scheduler_type": trainer.lr_schedule,
        f"{actor}.optim.total_training_steps": trainer.total_steps or total_steps,
        f"{actor}.optim.min_lr_ratio": trainer.min_lr_ratio,
        f"{actor}.optim.clip_grad": trainer.max_grad_norm,
        f"{actor}.grad_clip": trainer.max_grad_norm,
        f"{actor}.clip_ratio": trainer.clip_low,
        f"{actor}.clip_ratio_low": trainer.clip_low,
        f"{actor}.clip_ratio_high": trainer.clip_high,
        f"{actor}.clip_ratio_c": trainer.dual_clip_c,
        f"{actor}.loss_agg_mode": trainer.loss_agg,
        f"{actor}.loss_scale_factor": trainer.loss_scale_factor,
        f"{actor}.ppo_mini_batch_size": mini_batch,
        f"{actor}.ppo_micro_batch_size_per_gpu": micro,
        f"{actor}.ppo_epochs": trainer.ppo_epochs,
        f"{actor}.entropy_coeff": trainer.entropy_coef,
        f"{actor}.calculate_entropy": trainer.entropy_coef != 0,
        f"{actor}.use_kl_loss": trainer.use_kl_loss,
        f"{actor}.kl_loss_coef": trainer.kl_coef,
        f"{actor}.kl_loss_type": trainer.kl_kind,
        f"{actor}.shuffle": False,
        f"{actor}.data_loader_seed": trainer.seed,
        f"{actor}.fsdp_config.seed": trainer.seed,
        f"{actor}.fsdp_config.dtype": "bfloat16" if trainer.bf16 else "float32",
        f"{actor}.fsdp_config.param_offload": options.param_offload,
        f"{actor}.fsdp_config.optimizer_offload": options.optimizer_offload,
        "actor_rollout_ref.ref.fsdp_config.param_offload": options.param_offload,
        f"{actor}.checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
        "algorithm.adv_estimator": estimator,
        "algorithm.norm_adv_by_std_in_grpo": norm_by_std,
        "algorithm.gamma": trainer.gamma,
        "algorithm.use_kl_in_reward": trainer.kl_in_reward,
        "algorithm.kl_penalty": trainer.kl_kind,
        "algorithm.kl_ctrl.type": "fixed",
        "algorithm.kl_ctrl.kl_coef": trainer.kl_coef,
        "trainer.use_v1": False,
        "trainer.nnodes": options.nnodes,
        "trainer.n_gpus_per_node": options.n_gpus_per_node,
        "trainer.logger": ["console"],
    }
    if trainer.lora is not None:
        if trainer.lora.dropout:
            raise ValueError("algorithm.lora.dropout: verl's LoRA has no dropout; set it to 0 with the verl backend")
        targets = trainer.lora.target_modules
        values["actor_rollout_ref.model.lora_rank"] = trainer.lora.rank
        values["actor_rollout_ref.model.lora_alpha"] = trainer.lora.alpha
        values["actor_rollout_ref.model.target_modules"] = "all-linear" if targets == ["all-linear"] else targets
    return [f"{key}={_hydra_value(value)}" for key, value in values.items()] + list(options.overrides)


def _hydra_value(value: Any) -> str:
    """A value as hydra's override grammar reads it (lists as [a,b], booleans lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(item) for item in value) + "]"
    if isinstance(value, str) and any(ch in value for ch in " ,=[]{}()'\""):
        return json.dumps(value)
    return str(value)


def verl_config(
    model_dir: str | Path, trainer: TrainerConfig, options: VerlOptions, *, rows_per_step: int, total_steps: int
) -> Any:
    """verl's full PPO config (its ppo_trainer.yaml, composed by hydra) with our overrides: an OmegaConf DictConfig."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = verl_overrides(model_dir, trainer, options, rows_per_step=rows_per_step, total_steps=total_steps)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


# --- the driver's share of a step (runs on the CPU) ---------------------------------------------------------------


def batch_to_dataproto(batch: Any, temperature: float = 1.0) -> Any:
    """A TrainingBatch as the DataProto verl's workers take: our tensors under their keys, the group ids as `uid`.
    `temperature` divides the logits in verl's log-prob passes, as the torch trainer's `temperature` does."""
    from verl import DataProto

    return DataProto.from_dict(
        tensors=dict(batch.tensors),
        non_tensors={"uid": batch.uid},
        meta_info={**batch.meta_info, "temperature": temperature, "multi_turn": False},
    )


def driver_advantages(proto: Any, trainer: TrainerConfig, algorithm_config: Any) -> tuple[Any, dict[str, float]]:
    """token_level_rewards (minus the KL penalty with kl_in_reward) and advantages, by verl's own functions, on a
    DataProto that holds old_log_probs (and ref_log_prob when the config uses a reference)."""
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

    metrics: dict[str, float] = {}
    if trainer.kl_in_reward:
        proto, kl_metrics = apply_kl_penalty(proto, FixedKLController(trainer.kl_coef), kl_penalty=trainer.kl_kind)
        metrics.update(kl_metrics)
    else:
        proto.batch["token_level_rewards"] = proto.batch["token_level_scores"]
    estimator, norm_by_std = ADVANTAGE_ESTIMATORS[trainer.advantage]
    proto = compute_advantage(
        proto, adv_estimator=estimator, gamma=trainer.gamma, norm_adv_by_std_in_grpo=norm_by_std,
        config=algorithm_config,
    )  # fmt: skip
    if trainer.failed_group_advantage:  # ours: verl has no such option
        from lightning.algorithm.advantages import failed_group_advantages

        proto.batch["advantages"] = failed_group_advantages(
            proto.batch["advantages"], proto.batch["token_level_scores"], proto.batch["response_mask"].float(),
            list(proto.non_tensor_batch["uid"]), trainer.failed_group_advantage,
        )  # fmt: skip
    return proto, metrics


METRIC_NAMES = {
    "actor/pg_loss": "pg_loss",
    "actor/pg_clipfrac": "clip_frac",
    "actor/ppo_kl": "approx_kl",
    "actor/pg_clipfrac_lower": "dual_clip_frac",
    "actor/entropy_loss": "entropy",
    "actor/kl_loss": "kl_loss",
    "actor/grad_norm": "grad_norm",
    "actor/lr": "lr",
}
"""verl's update_actor metrics under the torch trainer's names (the rest keep verl's names)."""


def our_metrics(verl_metrics: dict[str, Any]) -> dict[str, float]:
    """verl's metrics (values may be lists, one per mini-batch) as floats under our names."""
    result: dict[str, float] = {}
    for key, value in verl_metrics.items():
        if isinstance(value, list | tuple):
            numbers = [float(v) for v in value if isinstance(v, int | float)]
            if not numbers:
                continue
            value = sum(numbers) / len(numbers)
        if isinstance(value, int | float):
            result[METRIC_NAMES.get(key, key)] = float(value)
    return result


# --- the worker group (GPU only) ----------------------------------------------------------------------------------


class VerlActorGroup:
    """verl's FSDP actor (and reference) workers on the Ray cluster's GPUs, built once and kept for the whole run.
    Runs inside the named Ray actor that `VerlTrainer` starts; never in the flow's process."""

    def __init__(
        self, model_dir: str, trainer: dict[str, Any], options: dict[str, Any], checkpoint_root: str,
        rows_per_step: int, total_steps: int, name: str,
    ) -> None:  # fmt: skip
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.single_controller.ray.base import create_colocated_worker_cls
        from verl.workers.engine_workers import ActorRolloutRefWorker

        self.model_dir = model_dir
        self.trainer = TrainerConfig.model_validate(trainer)
        self.options = VerlOptions.model_validate(options)
        self.checkpoint_root = Path(checkpoint_root)
        self.rows_per_step = rows_per_step
        self.config = verl_config(
            model_dir, self.trainer, self.options, rows_per_step=rows_per_step, total_steps=total_steps
        )
        pool = RayResourcePool(
            process_on_nodes=[self.options.n_gpus_per_node] * self.options.nnodes,
            use_gpu=True, max_colocate_count=1, name_prefix=f"{name}_pool",
        )  # fmt: skip
        worker = ray.remote(ActorRolloutRefWorker)
        roles = {"actor": RayClassWithInitArgs(cls=worker, config=self.config.actor_rollout_ref, role="actor")}
        if self.trainer.uses_reference:  # the KL anchor: the initial model, frozen
            roles["ref"] = RayClassWithInitArgs(cls=worker, config=self.config.actor_rollout_ref, role="ref")
        group = RayWorkerGroup(
            resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict=roles), device_name="cuda"
        )
        groups = group.spawn(prefix_set=roles.keys())
        self.ref = groups.get("ref")
        if self.ref is not None:
            self.ref.init_model()
        self.actor = groups["actor"]
        self.actor.init_model()
        self.step_count = 0
        self.resumed_from = self._resume()

    def _resume(self) -> int | None:
        """Load verl's state of our latest checkpoint (weights, optimizer, LR scheduler, RNG); its step."""
        from lightning.checkpoint import latest_checkpoint, load_checkpoint

        latest = latest_checkpoint(self.checkpoint_root)
        if latest is None:
            return None
        checkpoint = load_checkpoint(latest)
        state = checkpoint.meta.get("verl_state")
        if state is None:
            raise ValueError(f"checkpoint {latest} has no verl state (it was not written by the verl backend)")
        self.actor.load_checkpoint(state)
        self.step_count = int(checkpoint.meta.get("trainer_steps", checkpoint.step))
        return checkpoint.step

    def step(self, batch_path: str) -> dict[str, float]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        from lightning.algorithm.batch import TrainingBatch

        started = time.perf_counter()
        batch = TrainingBatch.load(batch_path)
        proto = batch_to_dataproto(batch, self.trainer.scoring_temperature)
        metrics: dict[str, float] = {}

        def log_probs(group: Any, method: str, **flags: Any) -> Any:
            packed = left_right_2_no_padding(proto.to_tensordict())
            tu.assign_non_tensor(packed, compute_loss=False, **flags)
            output = getattr(group, method)(packed)
            return no_padding_2_padding(tu.get(output, "log_probs"), packed).float()

        from lightning.algorithm.trainer import mismatch_metrics

        # As the torch trainer: the actor's log-probs, or the sampler's when asked for and the batch has them.
        # (proto.batch is a TensorDict.)
        sampled = proto.batch["rollout_log_probs"].float() if "rollout_log_probs" in proto.batch.keys() else None  # noqa: SIM118
        if sampled is not None and self.trainer.old_log_probs == "sampler":
            proto.batch["old_log_probs"] = sampled
        else:
            proto.batch["old_log_probs"] = log_probs(self.actor, "compute_log_prob", calculate_entropy=False)
        if sampled is not None:
            actor = (
                proto.batch["old_log_probs"]
                if self.trainer.old_log_probs == "trainer"
                else log_probs(self.actor, "compute_log_prob", calculate_entropy=False)
            )
            metrics.update(
                mismatch_metrics(sampled, actor, proto.batch["response_mask"].float(), self.trainer.mismatch_threshold)
            )
        if self.ref is not None:
            proto.batch["ref_log_prob"] = log_probs(self.ref, "compute_ref_log_prob", calculate_entropy=False)
        proto, kl_metrics = driver_advantages(proto, self.trainer, self.config.algorithm)
        metrics.update(kl_metrics)

        mini_batch = self.trainer.mini_batch_size or len(batch)
        packed = left_right_2_no_padding(proto.to_tensordict())
        tu.assign_non_tensor(
            packed, calculate_entropy=self.trainer.entropy_coef != 0, distillation_use_topk=False,
            distillation_only=False, global_batch_size=mini_batch, mini_batch_size=mini_batch,
            epochs=self.trainer.ppo_epochs, seed=self.trainer.seed, dataloader_kwargs={"shuffle": False},
            compute_loss=True,
        )  # fmt: skip
        output = self.actor.update_actor(packed)
        metrics.update(our_metrics(tu.get(output, "metrics")))
        self.step_count += 1
        seconds = time.perf_counter() - started
        metrics.update(
            step=float(self.step_count),
            step_time_s=seconds,
            tokens_per_s=float(batch["attention_mask"].sum()) / seconds,
            reward_mean=float(batch["token_level_scores"].sum(-1).mean()),
        )
        return metrics

    def save_checkpoint(self, step: int, meta: dict[str, Any], keep_last: int | None) -> str:
        """verl's checkpoint of `step` plus its Hugging Face export as our `step-*` directory (vLLM loads it)."""
        from transformers import AutoTokenizer

        from lightning.checkpoint import save_checkpoint

        state = self.checkpoint_root / VERL_STATE_DIR / f"global_step_{step}"
        self.actor.save_checkpoint(str(state), None, step, keep_last)
        export = HuggingFaceExport(state / "huggingface")
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        meta = {**meta, "verl_state": str(state), "trainer_steps": self.step_count, "backend": "verl"}
        return str(save_checkpoint(self.checkpoint_root, step, export, tokenizer, meta=meta, keep_last=keep_last))


class HuggingFaceExport:
    """A model directory verl exported, with the `save_pretrained` that `save_checkpoint` calls on a model."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def save_pretrained(self, destination: str | Path) -> None:
        if not (self.directory / "config.json").is_file():
            raise FileNotFoundError(f"verl wrote no Hugging Face model to {self.directory} (hf_model not saved?)")
        for path in self.directory.iterdir():
            if path.is_file() and not path.name.startswith("tokenizer"):
                shutil.copy2(path, Path(destination) / path.name)


# --- the client (the flow's side) ---------------------------------------------------------------------------------


class VerlTrainerTimeout(TimeoutError):
    """A verl call passed its deadline; the actor and its workers were killed."""


class VerlTrainer:
    """The TrainerWorker's interface over a named, detached Ray actor holding verl's worker group.

    The actor is named after the run, so a retried flow or a Prefect task in another process finds the same
    workers (and their GPU memory) instead of starting a second group. A call that passes its deadline kills the
    actor; the next call starts a new one, which resumes from the latest checkpoint.
    """

    def __init__(
        self, model_dir: str | Path, config: TrainerConfig, checkpoint_root: str | Path, *, options: VerlOptions,
        run_name: str, rows_per_step: int, total_steps: int, ray_address: str | None = None,
    ) -> None:  # fmt: skip
        """`ray_address`: the Ray cluster (`auto`, `HOST:6379`); None: the one this process is connected to,
        RAY_ADDRESS, or a new local one."""
        self.model_dir = str(model_dir)
        self.config = config
        self.checkpoint_root = str(checkpoint_root)
        self.options = options
        self.name = f"lightning-verl-{run_name}"
        self.rows_per_step = rows_per_step
        self.total_steps = total_steps
        self.ray_address = ray_address
        self._actor: Any = None

    def start(self) -> None:
        """Connect to Ray, and find or create the run's actor; waits until its workers are up."""
        import ray

        if self._actor is not None:
            return

        raycluster.connect(self.ray_address, self.options.ray_namespace)
        remote = ray.remote(num_cpus=1, max_restarts=0)(VerlActorGroup)
        self._actor = remote.options(
            name=self.name, namespace=self.options.ray_namespace, lifetime="detached", get_if_exists=True
        ).remote(
            self.model_dir, self.config.model_dump(mode="json"), self.options.model_dump(mode="json"),
            self.checkpoint_root, self.rows_per_step, self.total_steps, self.name,
        )  # fmt: skip
        self._get(self._actor.__ray_ready__.remote(), "start", self.options.start_timeout)

    def step(self, batch_path: str | Path, *, timeout: float) -> dict[str, float]:
        self.start()
        return self._get(self._actor.step.remote(str(batch_path)), "step", timeout)

    def sft_step(self, batch_path: str | Path, *, timeout: float) -> dict[str, float]:
        # TrainConfig already refuses warm_start with the verl backend; this guards direct library use.
        raise RuntimeError(
            "warm_start: the verl backend has no supervised step; run the warm start with the torch trainer (or SFT "
            "with verl's sft_trainer) and give its checkpoint as `model`"
        )

    def save_checkpoint(
        self, step: int, *, meta: dict[str, Any] | None = None, keep_last: int | None = 3, timeout: float = 600
    ) -> str:
        self.start()
        return self._get(self._actor.save_checkpoint.remote(step, meta or {}, keep_last), "save_checkpoint", timeout)

    def close(self) -> None:
        """Kill the actor (its workers and their GPU memory go with it)."""
        import ray

        if self._actor is not None and ray.is_initialized():
            ray.kill(self._actor, no_restart=True)
        self._actor = None

    def _get(self, ref: Any, op: str, timeout: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise VerlTrainerTimeout(
                f"verl {op} did not answer within {timeout:g}s; killed its workers, and the next call starts them "
                "again from the latest checkpoint"
            ) from None
