"""agent-lightning's algorithm objects for `Trainer(algorithm=...)`, mapped onto this project's runs: `VERL(config)`
(agl's verl config -> TrainConfig fields), `APO(client, ...)` (the `apo` section, run by the `optimize_prompt`
flow) and `Algorithm` / `@algo` (a custom algorithm, run against the store while the Trainer's runners run the agent).

    VERL(config)                       the `train` flow with trainer_backend verl (CUDA GPUs and verl);
    VERL(config, trainer_backend="torch")  the same mapping on our torch trainer (a CPU or one GPU)
    APO(client, beam_width=2, ...)     the `optimize_prompt` flow; the optimiser is the client's endpoint and models
    @algo async def f(*, store, ...)   f runs in this process with the store; the Trainer's runners run the agent
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# --- VERL ---------------------------------------------------------------------------------------------------------

_ACTOR = "actor_rollout_ref.actor."
VERL_FIELDS: dict[str, str] = {
    "data.train_batch_size": "batch_size",
    "data.max_prompt_length": "max_prompt_length",
    "data.max_response_length": "max_response_length",
    "data.seed": "seed",
    "actor_rollout_ref.rollout.n": "samples_per_task",
    "actor_rollout_ref.model.path": "model",
    "actor_rollout_ref.model.lora_rank": "algorithm.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "algorithm.lora.alpha",
    "actor_rollout_ref.model.target_modules": "algorithm.lora.target_modules",
    _ACTOR + "optim.lr": "algorithm.lr",
    _ACTOR + "optim.weight_decay": "algorithm.weight_decay",
    _ACTOR + "optim.betas": "algorithm.betas",
    _ACTOR + "optim.lr_warmup_steps": "algorithm.warmup_steps",
    _ACTOR + "optim.min_lr_ratio": "algorithm.min_lr_ratio",
    _ACTOR + "ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    _ACTOR + "ppo_epochs": "algorithm.ppo_epochs",
    _ACTOR + "clip_ratio_low": "algorithm.clip_low",
    _ACTOR + "clip_ratio_high": "algorithm.clip_high",
    _ACTOR + "clip_ratio_c": "algorithm.dual_clip_c",
    _ACTOR + "entropy_coeff": "algorithm.entropy_coef",
    _ACTOR + "grad_clip": "algorithm.max_grad_norm",
    _ACTOR + "use_kl_loss": "algorithm.use_kl_loss",
    _ACTOR + "loss_agg_mode": "algorithm.loss_agg",
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward",
    "algorithm.gamma": "algorithm.gamma",
    "trainer.total_training_steps": "iterations",
    "trainer.experiment_name": "run_name",
    "trainer.project_name": "experiment",
}
"""agl's verl config (dotted) -> our TrainConfig field (dotted), value as it is. The rest of the mapping is in
`verl_fields`: fields that need a conversion or depend on the backend."""

VERL_ONLY_FIELDS: dict[str, str] = {
    "trainer.n_gpus_per_node": "verl.n_gpus_per_node",
    "trainer.nnodes": "verl.nnodes",
    _ACTOR + "strategy": "verl.strategy",
    _ACTOR + "fsdp_config.param_offload": "verl.param_offload",
    _ACTOR + "fsdp_config.optimizer_offload": "verl.optimizer_offload",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "verl.gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding": "verl.use_remove_padding",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "inference.vllm.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "inference.vllm.tensor_parallel_size",
}
"""Fields that mean the verl cluster and its vLLM; on the torch trainer the two that have a meaning there become
`algorithm.gradient_checkpointing` and `algorithm.pack_sequences`, the others are not used."""

ADVANTAGES = {
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
}
"""verl's algorithm.adv_estimator -> our TrainerConfig.advantage (grpo without std: grpo_no_std)."""
KL_KINDS = {"kl": "k1", "k1": "k1", "low_var_kl": "low_var_kl", "k3": "low_var_kl"}
"""verl's kl_loss_type / kl_penalty -> our TrainerConfig.kl_kind."""


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _put(fields: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for parent in parents:
        fields = fields.setdefault(parent, {})
    fields[last] = value


def verl_fields(
    config: Mapping[str, Any], trainer_backend: Literal["verl", "torch"]
) -> tuple[dict[str, Any], int | None, list[str]]:
    """agl's verl config as TrainConfig fields: (fields, trainer.total_epochs, the settings not used here)."""
    flat = _flatten(config)
    fields: dict[str, Any] = {"trainer_backend": trainer_backend}
    used: set[str] = set()

    def take(key: str) -> Any:
        used.add(key)
        return flat[key]

    for key, field in VERL_FIELDS.items():
        if key in flat:
            _put(fields, field, take(key))
    if trainer_backend == "verl":
        for key, field in VERL_ONLY_FIELDS.items():
            if key in flat:
                _put(fields, field, take(key))
        if flat.get("actor_rollout_ref.rollout.name") == "vllm":
            _put(fields, "inference.backend", take("actor_rollout_ref.rollout.name"))
    else:
        for key, field in (
            ("actor_rollout_ref.model.enable_gradient_checkpointing", "algorithm.gradient_checkpointing"),
            ("actor_rollout_ref.model.use_remove_padding", "algorithm.pack_sequences"),
        ):
            if key in flat:
                _put(fields, field, bool(take(key)))

    estimator = flat.get("algorithm.adv_estimator")
    if estimator is not None:
        if take("algorithm.adv_estimator") not in ADVANTAGES:
            raise ValueError(
                f"VERL: algorithm.adv_estimator {estimator!r} has no counterpart here (no critic, no ReMax); use one "
                f"of {sorted(ADVANTAGES)}"
            )
        advantage = ADVANTAGES[estimator]
        if advantage == "grpo" and flat.get("algorithm.norm_adv_by_std_in_grpo") is False:
            advantage = "grpo_no_std"
        _put(fields, "algorithm.advantage", advantage)
    used.add("algorithm.norm_adv_by_std_in_grpo")
    for key in (_ACTOR + "kl_loss_type", "algorithm.kl_penalty"):
        if key in flat:
            if take(key) not in KL_KINDS:
                raise ValueError(f"VERL: {key} {flat[key]!r} has no counterpart here; use one of {sorted(KL_KINDS)}")
            _put(fields, "algorithm.kl_kind", KL_KINDS[flat[key]])
    # One kl_coef here: the loss's (kl_loss_coef) or the reward's (kl_ctrl.kl_coef), whichever is in use.
    coefficients = {
        key: take(key)
        for key, on in (
            (_ACTOR + "kl_loss_coef", _ACTOR + "use_kl_loss"),
            ("algorithm.kl_ctrl.kl_coef", "algorithm.use_kl_in_reward"),
        )
        if key in flat and flat.get(on)
    }
    used.update(key for key in (_ACTOR + "kl_loss_coef", "algorithm.kl_ctrl.kl_coef") if key in flat)
    if len(set(coefficients.values())) > 1:
        raise ValueError(f"VERL: {coefficients} differ; one kl_coef serves both here (algorithm.kl_coef)")
    if coefficients:
        _put(fields, "algorithm.kl_coef", next(iter(coefficients.values())))
    if _ACTOR + "clip_ratio" in flat:
        for side in ("clip_low", "clip_high"):
            fields.setdefault("algorithm", {}).setdefault(side, take(_ACTOR + "clip_ratio"))
    # verl's ppo_mini_batch_size counts prompts; ours counts rows (each prompt's `n` samples).
    if _ACTOR + "ppo_mini_batch_size" in flat:
        samples = flat.get("actor_rollout_ref.rollout.n", 1)
        _put(fields, "algorithm.mini_batch_size", take(_ACTOR + "ppo_mini_batch_size") * samples)
    if "trainer.test_freq" in flat:
        _put(fields, "eval_every", max(0, take("trainer.test_freq")))
    # verl's rollouts sample at most data.max_response_length tokens (rollout.response_length), at rollout.temperature
    # (1.0) in training and rollout.val_kwargs.temperature (0: greedy) in validation.
    length = flat.get("actor_rollout_ref.rollout.response_length", flat.get("data.max_response_length"))
    if length is not None:
        used.add("actor_rollout_ref.rollout.response_length")
        for field, prefix, temperature in (
            ("sampling", "actor_rollout_ref.rollout.", 1.0),
            ("eval_sampling", "actor_rollout_ref.rollout.val_kwargs.", 0.0),
        ):
            sampling = {"temperature": take(prefix + "temperature") if prefix + "temperature" in flat else temperature}
            if prefix + "top_p" in flat:
                sampling["top_p"] = take(prefix + "top_p")
            fields[field] = {**sampling, "max_tokens": length}
    level = flat.get("agentlightning.trace_aggregator.level")
    if level is not None:
        _put(fields, "adapter_shape", take("agentlightning.trace_aggregator.level"))
    if "lora" in fields.get("algorithm", {}) and fields["algorithm"]["lora"].get("rank") == 0:
        del fields["algorithm"]["lora"]  # verl's lora_rank 0: full fine-tuning
    total_epochs = take("trainer.total_epochs") if "trainer.total_epochs" in flat else None
    return fields, total_epochs, sorted(set(flat) - used)


def verl_stack_problem() -> str | None:
    """Why this machine cannot run trainer_backend verl (no CUDA device, or no verl); None when it can."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    if importlib.util.find_spec("verl") is None:
        return "verl is not installed (pip install -e '.[gpu]')"
    return None


class VERL:
    """agl's `VERL(config)`: its verl config dict, mapped onto the `train` flow's TrainConfig (`fields`); what has no
    counterpart is listed in `ignored` and logged. `trainer_backend="torch"` maps the same config onto our torch
    trainer (a CPU or one GPU) instead of verl's FSDP workers: ask for it, it is never chosen for you."""

    def __init__(self, config: Mapping[str, Any], *, trainer_backend: Literal["verl", "torch"] = "verl") -> None:
        self.config = copy.deepcopy(dict(config))
        self.trainer_backend = trainer_backend
        self.fields, self.total_epochs, self.ignored = verl_fields(self.config, trainer_backend)
        if self.ignored:
            logger.warning("VERL: these verl settings have no counterpart here and are not used: %s", self.ignored)

    def run_fields(self, n_train_tasks: int | None) -> dict[str, Any]:
        """`fields`, with `iterations` from trainer.total_epochs (verl's steps: full batches per epoch) when
        trainer.total_training_steps does not give it."""
        fields = copy.deepcopy(self.fields)
        if "iterations" not in fields and self.total_epochs is not None and n_train_tasks is not None:
            batch_size = fields.get("batch_size", 1)
            fields["iterations"] = max(1, n_train_tasks // batch_size) * self.total_epochs
        return fields

    def refusal(self) -> str | None:
        """One line when this machine cannot run this VERL (backend verl without a GPU stack); None when it can."""
        if self.trainer_backend != "verl":
            return None
        problem = verl_stack_problem()
        if problem is None:
            return None
        return (
            f"VERL(config) trains with verl's FSDP workers, which need CUDA GPUs and verl, and {problem}: run it on a "
            "GPU machine, or give lightning.VERL(config, trainer_backend='torch') to train with our torch trainer "
            "here (the same mapping; set actor_rollout_ref.model.path to a local model directory or 'tiny')"
        )


# --- APO ----------------------------------------------------------------------------------------------------------

OPENAI_BASE_URL = "https://api.openai.com/v1"


class APO(Generic[T]):
    """agl's `APO(async_openai_client, beam_width=..., ...)`: the `apo` section of the run, run by the
    `optimize_prompt` flow. The optimiser models are called with LiteLLM at the client's `base_url`; its key must be
    in an environment variable (`api_key_env`, default OPENAI_API_KEY, which the client read), never in the config.
    The seed prompt is the Trainer's one PromptTemplate of `initial_resources`, under its name."""

    def __init__(
        self,
        async_openai_client: Any = None,
        *,
        gradient_model: str = "gpt-5-mini",
        apply_edit_model: str = "gpt-4.1-mini",
        diversity_temperature: float = 1.0,
        gradient_batch_size: int = 4,
        val_batch_size: int = 16,
        beam_width: int = 4,
        branch_factor: int = 4,
        beam_rounds: int = 3,
        rollout_batch_timeout: float = 3600.0,
        run_initial_validation: bool = True,
        _poml_trace: bool = False,
        api_key_env: str | None = None,
    ) -> None:
        if not run_initial_validation:
            raise ValueError(
                "APO(run_initial_validation=False): the seed prompt is always scored on the validation batch here "
                "(the beam starts from its score); leave it out"
            )
        api_base = None
        if async_openai_client is not None:
            base_url = str(getattr(async_openai_client, "base_url", "") or "").rstrip("/")
            api_base = None if base_url in ("", OPENAI_BASE_URL) else base_url
            key = getattr(async_openai_client, "api_key", None)
            api_key_env = api_key_env or "OPENAI_API_KEY"
            if key and os.environ.get(api_key_env) != key:
                raise ValueError(
                    f"APO: the client's API key is not ${api_key_env}; the run's processes read the optimiser's key "
                    "from their environment: put it in a variable and give APO(client, api_key_env='NAME')"
                )
        self.rollout_batch_timeout = rollout_batch_timeout
        self.apo_fields: dict[str, Any] = {
            "gradient_model": _litellm_model(gradient_model, api_base),
            "apply_edit_model": _litellm_model(apply_edit_model, api_base),
            "api_base": api_base,
            "api_key_env": api_key_env,
            "diversity_temperature": diversity_temperature,
            "gradient_batch_size": gradient_batch_size,
            "val_batch_size": val_batch_size,
            "beam_width": beam_width,
            "branch_factor": branch_factor,
            "beam_rounds": beam_rounds,
        }
        """The `apo` section's fields, less the seed prompt (the Trainer's initial_resources give it)."""

    def __class_getitem__(cls, item: Any) -> Any:  # `APO[RoomSelectionTask](...)`, as agl's generic class
        return cls


def _litellm_model(model: str, api_base: str | None) -> str:
    """A model of an OpenAI-compatible endpoint as LiteLLM names it: `openai/<model>` at a base URL of its own."""
    return f"openai/{model}" if api_base is not None and "/" not in model else model


# --- Algorithm and @algo ------------------------------------------------------------------------------------------


class Algorithm:
    """agl's `Algorithm`: subclass it with `run(train_dataset, val_dataset)` (sync or async), which enqueues rollouts
    in `self.get_store()` and reads their spans; `Trainer(algorithm=...).fit(agent, ...)` runs it in this process
    while the Trainer's `n_runners` runners run the agent on what it enqueues, and stops them when it returns."""

    def __init__(self) -> None:
        self._store: Any = None
        self._trainer: Any = None
        self._adapter: Any = None
        self._initial_resources: dict[str, Any] | None = None
        self._llm_proxy: Any = None

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)

    def set_trainer(self, trainer: Any) -> None:
        self._trainer = trainer

    def _given(self, value: Any, missing: str) -> Any:
        if value is None:
            raise ValueError(f"{type(self).__name__}: {missing}")
        return value

    def get_trainer(self) -> Any:
        return self._given(self._trainer, "no Trainer runs it yet")

    def set_store(self, store: Any) -> None:
        self._store = store

    def get_store(self) -> Any:
        return self._given(self._store, "no store yet; Trainer(algorithm=...).fit(agent) sets it")

    def set_llm_proxy(self, llm_proxy: Any) -> None:
        self._llm_proxy = llm_proxy

    def get_llm_proxy(self) -> Any:
        """The Trainer's `llm_proxy` (agl's LLMProxy, lightning.agl_llm_proxy), else None: the runners then call the
        LLMs that the resources name."""
        return self._llm_proxy

    def set_adapter(self, adapter: Any) -> None:
        self._adapter = adapter

    def get_adapter(self) -> Any:
        return self._given(
            self._adapter,
            "no adapter; give Trainer(adapter=lightning.adapter.TraceToMessages()), or call "
            "lightning.adapter.spans_to_triplets / spans_to_messages on the spans",
        )

    def set_initial_resources(self, resources: Mapping[str, Any]) -> None:
        self._initial_resources = dict(resources)

    def get_initial_resources(self) -> dict[str, Any] | None:
        return self._initial_resources

    def run(self, train_dataset: Any = None, val_dataset: Any = None) -> Any:
        # The abstract method of agl's `Algorithm`, as there: a subclass defines it (or use `@algo` on a function).
        raise NotImplementedError(
            f"{type(self).__name__} does not define run(train_dataset, val_dataset): an Algorithm subclass must"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


_INJECTED = ("store", "adapter", "llm_proxy", "initial_resources")


class FunctionalAlgorithm(Algorithm, Generic[T]):
    """`@algo`'s algorithm: the function's keywords among store, train_dataset, val_dataset, llm_proxy, adapter and
    initial_resources are given to it, the others left out (agl's rule)."""

    def __init__(self, algorithm_func: Any) -> None:
        super().__init__()
        self._algorithm_func = algorithm_func
        self._parameters = inspect.signature(algorithm_func).parameters
        self.__name__ = getattr(algorithm_func, "__name__", type(self).__name__)
        self.__doc__ = getattr(algorithm_func, "__doc__", None)

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self._algorithm_func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._algorithm_func(*args, **kwargs)

    def run(self, train_dataset: Any = None, val_dataset: Any = None) -> Any:
        getters = {
            "store": self.get_store,
            "adapter": lambda: self._adapter,
            "llm_proxy": self.get_llm_proxy,
            "initial_resources": self.get_initial_resources,
        }
        kwargs = {name: getters[name]() for name in _INJECTED if name in self._parameters}
        for name, dataset in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if name in self._parameters:
                kwargs[name] = dataset
            elif dataset is not None:
                raise TypeError(f"{self.__name__} takes no {name}, and one was given to fit")
        return self._algorithm_func(**kwargs)


def algo(func: Any) -> FunctionalAlgorithm[Any]:
    """agl's `@algo`: a function (sync or async) as an Algorithm for `Trainer(algorithm=...)`."""
    return FunctionalAlgorithm(func)


# --- FastAlgorithm and Baseline -----------------------------------------------------------------------------------


class FastAlgorithm(Algorithm):
    """agl's base of algorithms for a quick look at an agent: `Trainer(algorithm=...)` runs one with `dev` as with
    `fit`."""


class Baseline(FastAlgorithm):
    """agl's Baseline: every task of `train_dataset` (mode train) then of `val_dataset` (mode val), `n_epochs` times,
    through the Trainer's runners, with the Trainer's `initial_resources`; nothing is trained. Each finished rollout
    is logged with its attempts, its spans (`span_verbosity`: "keys", "key_values" or "none") and what the Trainer's
    adapter makes of its latest attempt's spans; at most `max_queue_length` rollouts wait in the queue at once, the
    store polled every `polling_interval` seconds. The finished rollouts are kept in `finished`, in the order they
    finished. `train_split` is checked as agl checks it and, as there, not used."""

    def __init__(
        self,
        *,
        n_epochs: int = 1,
        train_split: float = 0.5,
        polling_interval: float = 5.0,
        max_queue_length: int = 4,
        span_verbosity: Literal["keys", "key_values", "none"] = "keys",
    ) -> None:
        super().__init__()
        if not 0.0 < train_split < 1.0:
            raise ValueError("Baseline: train_split must be between 0 and 1")
        if span_verbosity not in ("keys", "key_values", "none"):
            raise ValueError("Baseline: span_verbosity must be 'keys', 'key_values' or 'none'")
        self.n_epochs = n_epochs
        self.train_split = train_split
        self.polling_interval = polling_interval
        self.max_queue_length = max_queue_length
        self.span_verbosity = span_verbosity
        self.finished: list[Any] = []

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        store = self.get_store()
        tasks = [(task, "train") for task in _tasks(train_dataset)] + [(task, "val") for task in _tasks(val_dataset)]
        if not tasks:
            raise ValueError("Baseline: give train_dataset or val_dataset (Trainer(...).fit(agent, train, val))")
        proxy = self._llm_proxy
        started = proxy is not None and not proxy.is_running()
        if started:  # agl's Baseline starts a proxy it was given and stops it after
            await proxy.start()
        try:
            await self._run(store, tasks)
        finally:
            if started:
                await proxy.stop()

    async def _run(self, store: Any, tasks: list[tuple[Any, str]]) -> None:
        resources_id = None
        if self._initial_resources:
            resources_id = (await store.add_resources(self._initial_resources)).resources_id
        for epoch in range(self.n_epochs):
            logger.info("Baseline: epoch %d of %d, %d tasks", epoch + 1, self.n_epochs, len(tasks))
            pending: list[str] = []
            for task, mode in tasks:
                while len(await store.query_rollouts(status_in=["queuing", "requeuing"])) > self.max_queue_length:
                    pending = await self._harvest(pending, wait=self.polling_interval)
                rollout = await store.enqueue_rollout(input=task, mode=mode, resources_id=resources_id)
                logger.info("Baseline: enqueued %s (%s): %s", rollout.rollout_id, mode, task)
                pending.append(rollout.rollout_id)
            while pending:
                pending = await self._harvest(pending, wait=self.polling_interval)

    async def _harvest(self, pending: list[str], *, wait: float) -> list[str]:
        """Log the rollouts of `pending` that finish within `wait` seconds; the ones still running."""
        store = self.get_store()
        done = await store.wait_for_rollouts(rollout_ids=pending, timeout=wait)
        for rollout in done:
            self.finished.append(rollout)
            await self._log(rollout)
        finished = {rollout.rollout_id for rollout in done}
        return [rollout_id for rollout_id in pending if rollout_id not in finished]

    async def _log(self, rollout: Any) -> None:
        store = self.get_store()
        logger.info("Baseline: rollout %s finished: %s", rollout.rollout_id, rollout.status)
        for attempt in await store.query_attempts(rollout.rollout_id):
            logger.info(
                "Baseline: rollout %s attempt %s (%s): %s on %s",
                rollout.rollout_id, attempt.sequence_id, attempt.attempt_id, attempt.status, attempt.worker_id,
            )  # fmt: skip
            if self.span_verbosity == "none":
                continue
            for span in await store.query_spans(rollout.rollout_id, attempt.attempt_id):
                shown = span.attributes if self.span_verbosity == "key_values" else sorted(span.attributes)
                logger.info("Baseline: span #%d %s: %s", span.sequence_id, span.name, shown)
        if self._adapter is not None:
            adapted = self._adapter.adapt(list(await store.query_spans(rollout.rollout_id, "latest")))
            logger.info("Baseline: rollout %s adapted: %s", rollout.rollout_id, adapted)


def _tasks(dataset: Any) -> list[Any]:
    return [] if dataset is None else [dataset[index] for index in range(len(dataset))]


__all__ = ["APO", "VERL", "Algorithm", "Baseline", "FastAlgorithm", "FunctionalAlgorithm", "algo"]
