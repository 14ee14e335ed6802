"""One training run's configuration: `TrainConfig`, the parameter type of the Prefect flows (the UI renders
it as a form), loadable from YAML.

Every field has a default that trains on embedded parts on one machine; a run needs only a name, an agent
and a dataset. Validation errors name the field and say how to fix it.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from lightning.agent import LitAgent
from lightning.agl_import_paths import missing
from lightning.algorithm.config import TrainerConfig, VerlOptions
from lightning.config_file import (
    DEFAULT_OUTPUT_DIR,
    DEFAULT_RUN_NAME,
    apply_overrides,
    read_config_file,
)
from lightning.devices import DeviceSetting
from lightning.errors import ConfigError
from lightning.metrics import DEFAULT_TRACKING_URI
from lightning.serving import is_loopback
from lightning.store.sql import DEFAULT_URL as DEFAULT_STORE_URL
from lightning.types import LLM, POLICY_MODEL_NAME, PromptTemplate, RolloutConfig

StaticResource = Annotated[LLM | PromptTemplate, Field(discriminator="resource_type")]
"""What `TrainConfig.resources` holds: resources handed to rollouts as they are (no ProxyLLM: the run has its own)."""
ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _matching(pattern: re.Pattern[str], value: str, fix: str) -> str:
    """`value` if `pattern` matches it, else a ValueError that says `fix` (pydantic names the field)."""
    if not pattern.match(value):
        raise ValueError(fix)
    return value


class InferenceConfig(BaseModel):
    """Where rollouts get their completions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    backend: Literal["embedded", "vllm", "external"] = "embedded"
    """embedded: our CPU/GPU server on the model; vllm: `vllm serve` on the model; external: an OpenAI-compatible
    endpoint that serves the policy (it cannot load new weights, so training does not change what it answers)."""
    endpoint: str | None = None
    """A running server's base URL (".../v1") to use instead of starting one; required for `external`."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the endpoint's API key (never the key itself)."""
    served_model_name: str = POLICY_MODEL_NAME
    """The model name rollouts ask the proxy for (the LLM resource's `model`)."""
    max_batch_size: int = Field(default=64, ge=1)
    """Embedded server: sequences decoded together."""
    device: DeviceSetting = "auto"
    """Embedded server: where it runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The served weights' dtype, whatever the checkpoint holds (the trainer saves float32 unless
    algorithm.bf16_weights). Embedded server: auto is bfloat16 on a GPU that has it (half the memory, the trainer's
    bf16 forward's numerics), float32 on a CPU. vllm backend: vLLM's --dtype (auto: vLLM's own choice)."""
    in_process: bool = False
    """Embedded server: run it on a thread of the flow's process instead of a process of its own."""
    with_proxy: bool = False
    """Embedded server: the run's LLM proxy runs in the server's process and hands it calls without HTTP, one
    process and one hop fewer (0.14-0.33 ms of CPU a rollout less on 2 cores, of about 2: docs/benchmarks.md, "The
    rollout path's CPU"). The demo's. Not with in_process or the run's proxy_in_process, which put them in the flow's
    process."""
    max_request_mb: float = Field(default=32, gt=0)
    """The largest request body, in MB, the run's LLM proxy and embedded inference server take: a larger one is
    answered 413 before it is read whole (a prompt too long for the model is refused before it is tokenized)."""
    access_log: bool = False
    """A log line per request of the run's LLM proxy and embedded inference server processes, in their logs (the
    run's `logs/proxy.log`, `logs/inference.log`). Off: thousands of calls a minute, each line 5-6% of a server's
    CPU (docs/benchmarks.md, "The rollout path's CPU")."""
    vllm: dict[str, Any] = Field(default_factory=dict)
    """vllm backend: fields of `lightning.inference.vllm.VllmConfig` (gpu_memory_utilization, ...)."""
    replicas: int = Field(default=1, ge=1)
    """vllm backend: servers started for the policy, all behind the LLM proxy (a rollout sticks to one)."""
    gpus_per_replica: int | None = Field(default=None, ge=1)
    """vllm backend: give replica i the GPUs [i * n, (i + 1) * n) through CUDA_VISIBLE_DEVICES; None: leave it."""
    max_restarts: int = Field(default=3, ge=0)
    """Times the run restarts each of its serving processes (embedded server, LLM proxy, vLLM replica) that dies or
    hangs; once one has used them up, the next rollout phase fails naming it."""
    weight_sync: Literal["reload", "sleep"] = "reload"
    """How new weights reach vLLM after each update. reload: the servers re-read the checkpoint in place. sleep: the
    servers share GPUs with the trainer (colocated), so they sleep (weights and KV cache released) during the PPO step
    and wake up on the new checkpoint. Either way the proxy holds new calls and drains the ones in flight first."""

    @model_validator(mode="after")
    def _endpoint_for_external(self) -> InferenceConfig:
        if self.backend == "external" and not self.endpoint:
            raise ValueError(
                "backend 'external' needs `endpoint`: the base URL of the server, e.g. http://host:8000/v1"
            )
        if self.with_proxy and (self.backend != "embedded" or self.endpoint is not None or self.in_process):
            raise ValueError(
                "with_proxy: only for the embedded server the run starts in a process of its own; leave it false "
                "with another backend, an endpoint or in_process"
            )
        if self.backend != "embedded" and self.device != "auto":
            raise ValueError(
                "device: only the embedded server takes a device; vLLM takes its GPUs from CUDA_VISIBLE_DEVICES "
                "(gpus_per_replica), an external endpoint is where it is. Leave device auto"
            )
        return self


class CheckpointPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    keep_last: int = Field(default=3, ge=1)
    """Checkpoints kept on disk (one is saved every iteration: the inference servers load it, and a run resumes
    from it); older ones are deleted."""
    log_every: int = Field(default=10, ge=1)
    """Upload every this many iterations' checkpoint to MLflow as artifacts; the last one always."""
    log_to_mlflow: bool = True
    """Upload checkpoints to MLflow as artifacts (every `log_every` iterations and the last)."""
    reserve_mb: float = Field(default=0, ge=0)
    """Megabytes the disk of the run directory must keep free beyond a checkpoint's size before one is written;
    short of it the checkpoint stage fails, naming the directory and what is free (a full disk would fail in the
    middle of writing)."""
    register_model: str | None = None
    """Register the final checkpoint in MLflow's model registry under this name, as a new version, with its held-out
    reward (`lightning mlflow promote NAME best` promotes the best). Every run that finishes with this set registers
    one, a short trial run too: clear it (null) for runs that should not."""


class MlflowTraces(BaseModel):
    """Which rollouts become MLflow traces, linked to the run (the store keeps every rollout's spans either way:
    it is the source of truth; MLflow shows a sample)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    train_per_iteration: int | Literal["all"] = 8
    """Training rollouts per iteration exported as traces, spread evenly over the iteration's rollouts; 0: none,
    `all`: every one."""
    evaluation: int | Literal["all"] = "all"
    """Held-out rollouts per evaluation exported as traces; 0: none, `all`: every one."""

    @field_validator("train_per_iteration", "evaluation")
    @classmethod
    def _count(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("give a number of rollouts (0: none) or `all`")
        return value


class StageTimeouts(BaseModel):
    """Seconds each stage may take. Prefect's timeout is the outer bound; the PPO step also has a hard deadline
    of its own (its process is killed), and rollouts stop waiting at `rollouts`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    startup: float = Field(default=600, gt=0)
    """Opening the run: store, inference server, proxy, trainer process, MLflow."""
    update_resources: float = Field(default=60, gt=0)
    """Publishing the new weights and resources to the store."""
    enqueue_rollouts: float = Field(default=120, gt=0)
    """Queueing an iteration's rollouts."""
    rollouts: float = Field(default=1800, gt=0)
    """Running an iteration's rollouts; unfinished ones are cancelled at this deadline."""
    adapt_spans: float = Field(default=600, gt=0)
    """Turning spans into training rows."""
    ppo_step: float = Field(default=1800, gt=0)
    """One update; past it the trainer process is killed (a hard deadline)."""
    checkpoint: float = Field(default=600, gt=0)
    """Saving the checkpoint and logging it."""
    evaluate: float = Field(default=1800, gt=0)
    """One held-out evaluation."""
    stall_warning: float = Field(default=900, gt=0)
    """Nothing finished (a stage, a rollout) for this long: the run logs the stacks of its processes."""
    blocked_loop: float = Field(default=30, gt=0)
    """An agent that holds its runner's event loop this long (a blocking call inside `async def`: `time.sleep`, a
    synchronous client) fails its rollout, naming the line; a loop still blocked once every rollout on it is past its
    `rollout.timeout_seconds` is given up and its runner task fails, to be retried (`lightning.runner.blocking`).
    Long enough for a busy machine's pauses: it only has to catch what would otherwise hang the run."""
    stop: float = Field(default=30, gt=0)
    """A run asked to stop (Ctrl-C, SIGTERM) ends its stage in flight, closes and exits within this; past it,
    `python -m flows.*` ends at once (its servers die with it)."""


class WarmStart(BaseModel):
    """A supervised warm start before the first iteration: a few SFT steps on demonstrations of some training tasks
    (the usual SFT-then-RL recipe). A policy that never produces a rewarded answer gives RL nothing to learn from."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    demonstrations: str
    """`module:function` called as function(tokenizer, tasks) -> list of Triplet (prompt ids, response ids)."""
    fraction: float = Field(default=0.3, gt=0, le=1)
    """Share of the training tasks demonstrated (the first ones of the dataset)."""
    steps: int = Field(default=15, ge=1)
    """Supervised steps (each over `batch_size` demonstrations). RL then starts with a fresh optimizer and schedule."""
    batch_size: int | None = Field(default=None, ge=1)
    """Demonstrations a step, drawn at random (seeded by `seed`) from all of them; None: all of them every step.
    Smaller batches make more, cheaper steps: the lookup example's copying is learned in about as many steps at 32
    demonstrations a step as at 128, for a quarter of the compute (docs/benchmarks.md, "Multi-turn")."""
    lr: float | None = Field(default=None, gt=0)
    """Learning rate of the supervised steps (None: `algorithm.lr`)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant: `lr` at every step; cosine: from `lr` down to 0 over the steps (a skill learned suddenly at a high
    rate then settles instead of being shaken by it: docs/benchmarks.md, "Multi-turn")."""
    stop_at_loss: float | None = Field(default=None, gt=0)
    """End the warm start at the first step whose sft_loss is this low or lower (the demonstrations are fit), with
    `steps` the most it takes: a skill learned suddenly is learned after a number of steps that depends on the seed
    (docs/benchmarks.md, "Multi-turn"). None: all `steps`."""

    def step_lr(self, step: int, lr: float) -> float:
        """The learning rate of supervised step `step` (0 for the first) at peak rate `lr`."""
        if self.lr_schedule == "constant":
            return lr
        return lr * 0.5 * (1.0 + math.cos(math.pi * step / self.steps))

    @field_validator("demonstrations")
    @classmethod
    def _entry_point(cls, value: str) -> str:
        return _matching(ENTRY_POINT, value, "give module:function, e.g. examples.copy_task.agent:demonstrations")


class TinyModel(BaseModel):
    """The tiny model `model: tiny` builds (random weights, a tokenizer trained on the fly), for examples and tests
    on a CPU. A real model's tokenizer has its chat format's text as few tokens (`<tool_call>` as one); the tiny one
    gets merges for text given in `tokenizer_corpus`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    hidden_size: int = Field(default=64, ge=8)
    """Width of the model (its MLP is four times as wide)."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer layers."""
    init_std: float = Field(default=0.2, gt=0)
    """Standard deviation of the random initial weights. The default is wide, so an untrained model's replies vary;
    0.02 (Llama's) learns a task from scratch more evenly across seeds (docs/benchmarks.md, "Multi-turn")."""
    tokenizer_corpus: list[str] = Field(default_factory=list)
    """Text the tokenizer learns merges from besides its own corpus (e.g. an agent's tool-call format), so that text
    takes fewer tokens; the default tokenizer when empty."""


class ApoConfig(BaseModel):
    """Automatic prompt optimisation (the `optimize_prompt` flow): beam search over a prompt template by textual
    gradients (ProTeGi). Each round, the beam's prompts run on a batch of training tasks, an optimiser model
    critiques the low-reward transcripts and proposes edited prompts, and the best `beam_width` prompts on the
    validation batch stay. The field names follow agent-lightning 0.3's `APO`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    initial_prompt: str | None = None
    """The seed prompt template's text (give this or `initial_prompt_from`)."""
    initial_prompt_from: str | None = None
    """The seed prompt as `module:attr`, a string or a PromptTemplate (give this or `initial_prompt`)."""
    prompt_engine: Literal["f-string", "jinja"] = "f-string"
    """How the template is rendered: Python's str.format ({name}) or Jinja2 ({{ name }})."""
    resource_name: str = "prompt_template"
    """The name of the PromptTemplate resource in the rollouts' resources (beside `main_llm`)."""
    beam_width: int = Field(default=4, ge=1)
    """Prompts kept after each round."""
    branch_factor: int = Field(default=4, ge=1)
    """Edited prompts asked for from each prompt of the beam per round."""
    beam_rounds: int = Field(default=3, ge=1)
    """Rounds of critique, edit and selection."""
    gradient_batch_size: int = Field(default=4, ge=1)
    """Training tasks each prompt of the beam runs on per round; their lowest-reward transcripts are critiqued."""
    val_batch_size: int = Field(default=16, ge=1)
    """Validation tasks every candidate is scored on (the same tasks every round, so scores compare)."""
    gradient_model: str = "gpt-5-mini"
    """The LiteLLM model that writes the critique (the textual gradient): `gpt-5-mini`, `anthropic/...`,
    `openai/<name>` with `api_base` for any OpenAI-compatible server."""
    apply_edit_model: str = "gpt-4.1-mini"
    """The LiteLLM model that rewrites a prompt from the critique."""
    api_base: str | None = None
    """The optimiser models' endpoint (None: the provider's own)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the optimiser's API key (never the key itself); None: LiteLLM's
    usual variable for the provider (OPENAI_API_KEY, ANTHROPIC_API_KEY, ...)."""
    diversity_temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of the optimiser calls (edits of one prompt should differ)."""
    prompt_name: str | None = None
    """The name the best prompt is registered under in MLflow's prompt registry (default: the run's name)."""

    @model_validator(mode="after")
    def _one_seed(self) -> ApoConfig:
        if (self.initial_prompt is None) == (self.initial_prompt_from is None):
            raise ValueError(
                "initial_prompt: give the seed prompt either as text (`initial_prompt`) or as module:attr "
                "(`initial_prompt_from`), not both or neither"
            )
        if self.initial_prompt_from is not None and not ENTRY_POINT.match(self.initial_prompt_from):
            raise ValueError("initial_prompt_from: give module:attr, e.g. examples.room_booking.agent:INITIAL_PROMPT")
        if self.initial_prompt is not None and not self.initial_prompt.strip():
            raise ValueError("initial_prompt: the seed prompt is empty")
        return self

    def seed(self) -> PromptTemplate:
        """The seed prompt as a PromptTemplate (`initial_prompt`, or what `initial_prompt_from` names)."""
        if self.initial_prompt is not None:
            return PromptTemplate(template=self.initial_prompt, engine=self.prompt_engine)
        found = load_entry_point(str(self.initial_prompt_from), "apo.initial_prompt_from")
        if isinstance(found, PromptTemplate):
            return found
        if isinstance(found, str) and found.strip():
            return PromptTemplate(template=found, engine=self.prompt_engine)
        raise ConfigError(
            f"apo.initial_prompt_from: {self.initial_prompt_from} is a {type(found).__name__}; it must name a "
            "non-empty string or a lightning.types.PromptTemplate"
        )


def _default_rollout_config() -> RolloutConfig:
    return RolloutConfig(timeout_seconds=300, max_attempts=2, retry_condition=["failed", "timeout", "unresponsive"])


class SamplingParameters(BaseModel):
    """The sampling parameters a run may hand its agents (`sampling`, `eval_sampling`): OpenAI's, and the ones vLLM
    and the embedded server add. Only for checking: the config keeps the mapping as written, and agents pass it to
    the server as it is, so the types are strict (`max_tokens: "4"` or `4.0` would reach the server so)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        # One line for a wrong `stop`, not one per member of the union.
        if (
            value is None
            or isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(item, str) for item in value))
        ):
            return value
        raise ValueError("give a string or a list of strings")

    @classmethod
    def check(cls, values: dict[str, Any]) -> None:
        """Raise a ValidationError with one error per bad key: an unknown key with the known one it is likely a typo
        of, a wrong value with what is wanted. Raised from a TrainConfig field validator, its errors are the field's:
        `sampling.max_token: unknown key; did you mean max_tokens?`."""
        try:
            cls.model_validate(values)
        except ValidationError as exc:
            errors: list[InitErrorDetails] = []
            for error in exc.errors():
                details = InitErrorDetails(type=error["type"], loc=error["loc"], input=error["input"])
                if "ctx" in error:
                    details["ctx"] = error["ctx"]
                if error["type"] == "extra_forbidden":
                    close = difflib.get_close_matches(str(error["loc"][0]), cls.model_fields, n=1)
                    hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(cls.model_fields)}"
                    details["type"] = PydanticCustomError(UNKNOWN_KEY, "unknown key; {hint}", {"hint": hint})
                errors.append(details)
            raise ValidationError.from_exception_data(cls.__name__, errors) from None


UNKNOWN_KEY = "unknown_key"
"""The error type of a key a mapping field does not take (`sampling.max_token`)."""


class TrainConfig(BaseModel):
    """A training run: what to train, on what, with which algorithm, for how long, and where results go."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    run_name: str = DEFAULT_RUN_NAME
    """Names the run everywhere (store metadata, checkpoints, MLflow run). A run whose name exists resumes."""
    agent: str | None = None
    """The agent, as `module:function` (a @rollout function) or `module:Class` (a LitAgent subclass). Required to
    run: no agent is assumed (the demo's is `examples.copy_task.agent:copy_agent`)."""
    train_data: str | None = None
    """Training tasks: a .jsonl or .parquet file (one task per row), or `module:function` returning a list. Required
    to run: no dataset is assumed (the demo's is `examples.copy_task.data:train_tasks`)."""
    val_data: str | None = None
    """Held-out tasks, same forms; evaluated before training, every `eval_every` iterations and at the end. None: no
    held-out evaluation."""
    model: str = "tiny"
    """A Hugging Face model directory, or `tiny` (a tiny random-init model built locally, seeded by `seed`)."""
    tiny_model: TinyModel = Field(default_factory=TinyModel)
    """The model `model: tiny` builds: its size and its tokenizer's extra text."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """Where rollouts get their completions: the embedded server, vLLM, or an external endpoint."""
    proxy_endpoint: str | None = None
    """A running LLM proxy to use instead of starting one (its URL, without /v1)."""
    proxy_host: str = "127.0.0.1"
    """Where the run's own LLM proxy listens (vllm and external inference). Runners on other machines reach it at
    this address, so give the node's address (not 0.0.0.0); any non-loopback address needs a bearer token in
    $LIGHTNING_PROXY_TOKEN, which runners read from their environment (the store never holds it)."""
    proxy_any_agent_key: bool = False
    """The run's LLM proxy serves an agent's model calls on the route its runner handed it (signed with the run's
    token) whatever API key the agent sends, as agent-lightning's proxy does: its agents send "dummy" or their own
    OPENAI_API_KEY. False: every call needs the run's proxy token, which agents get as their LLM's `api_key`. Only
    with proxy_host on loopback; `Trainer` (agent-lightning's) turns it on unless told otherwise."""
    proxy_in_process: bool = False
    """Run the LLM proxy on a thread of the flow's process instead of a process of its own (which spares the
    runners its share of the interpreter lock)."""
    store_url: str = DEFAULT_STORE_URL
    """The store: sqlite:///path, postgresql://user@host/db, or http://host:port of a running store server."""
    tracking_uri: str = DEFAULT_TRACKING_URI
    """MLflow: a database URI, a directory, or a tracking server's http URL."""
    experiment: str = "lightning"
    """The MLflow experiment the run goes in."""
    mlflow_traces: MlflowTraces = Field(default_factory=MlflowTraces)
    """Rollouts exported to MLflow as traces of the run (LLM calls with their messages, tokens and latency, rewards),
    tagged with rollout_id, attempt, iteration, mode, task and reward."""
    system_metrics: bool = True
    """Log the flow's machine's CPU, memory, disk, network (and GPU) use to the MLflow run every 10 s
    ($MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL); needs psutil (and pynvml for GPUs)."""
    output_dir: str = DEFAULT_OUTPUT_DIR
    """The run's files (checkpoints, batches, state) go to output_dir/run_name."""

    algorithm: TrainerConfig = Field(default_factory=lambda: TrainerConfig(lr=1e-5))
    """The PPO/GRPO update: learning rate, clipping, advantages, KL."""
    warm_start: WarmStart | None = None
    """Supervised steps on demonstrations before iteration 0; None: start RL from the model as it is."""
    iterations: int = Field(default=10, ge=1)
    """Training iterations (each: rollouts, one update, a checkpoint)."""
    batch_size: int = Field(default=32, ge=1)
    """Tasks per iteration (each sampled `samples_per_task` times)."""
    samples_per_task: int = Field(default=4, ge=1)
    """Rollouts per task: the group of GRPO/RLOO advantages."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (every sample right, or every one wrong) carry no
    advantage; they are dropped, and more tasks are run until `batch_size` groups differ (at most
    `max_sampling_rounds` more rounds). Costs rollouts; keeps every update full of signal."""
    max_sampling_rounds: int = Field(default=3, ge=1)
    """dynamic_sampling: at most this many rounds of extra tasks per iteration, and `batch_size` extra tasks per round
    on average (each round asks for as many as the share of informative groups so far says are needed; the first
    runs with the batch, sized by the share an earlier iteration had); after them the update takes what differs."""
    keep_failed_groups: int = Field(default=0, ge=0)
    """dynamic_sampling: besides the `batch_size` groups that differ, the update takes up to this many groups whose
    samples all failed alike (equal rewards, at most 0), for `algorithm.failed_group_advantage` to push their answers
    down; 0, or an `algorithm.failed_group_advantage` of 0: they are dropped with the other flat groups. (Without
    dynamic sampling every group is in the update.)"""
    n_runners: int = Field(default=2, ge=1)
    """Runner tasks fanned out per iteration."""
    runner_concurrency: int = Field(default=32, ge=1)
    """Rollouts each runner task runs at once (async)."""
    rollout: RolloutConfig = Field(default_factory=_default_rollout_config)
    """Each rollout's timeouts and retries."""
    min_success_fraction: float = Field(default=0.9, ge=0, le=1)
    """Share of an iteration's rollouts (or an evaluation's) that must succeed: below it the rest are run again
    (`rollout_retries` rounds), and then the run fails rather than train on the survivors."""
    rollout_retries: int = Field(default=1, ge=0)
    """Rounds of running again the rollouts that failed, when fewer than `min_success_fraction` succeeded."""
    sampling: dict[str, Any] = Field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 64})
    """Sampling parameters of training rollouts, passed to the agent with the LLM resource."""
    eval_sampling: dict[str, Any] = Field(default_factory=lambda: {"temperature": 0.0, "max_tokens": 64})
    """Sampling parameters of held-out evaluation rollouts."""
    max_prompt_length: int = Field(default=1024, ge=1)
    """The longest prompt a training row may have, in tokens: a row whose prompt is longer is dropped, not cut (a
    cut prompt is not what the model answered), and counted in the batch's report (`prompt_too_long`)."""
    max_response_length: int = Field(default=512, ge=1)
    """Response tokens kept per training row: a longer response is cut to its first max_response_length tokens,
    the reward on the last one kept (counted as `response_truncated`)."""
    adapter_shape: Literal["transition", "trajectory"] = "transition"
    """transition: one training row per LLM call; trajectory: one row per rollout, its turns joined."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate on val_data every this many iterations (0: only before training and at the end)."""
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    """What is kept on disk, uploaded to MLflow and registered."""
    timeouts: StageTimeouts = Field(default_factory=StageTimeouts)
    """Seconds each stage may take."""
    trainer_backend: Literal["torch", "verl"] = "torch"
    """torch: our trainer in a process of its own (CPU or one GPU); verl: verl's FSDP workers on a Ray cluster."""
    verl: VerlOptions = Field(default_factory=VerlOptions)
    """trainer_backend verl: the cluster shape (GPUs per node, nodes), FSDP offload options, raw verl overrides."""
    trainer_threads: int | None = Field(default=None, ge=1)
    """torch threads of the trainer process (None: half the cores on a CPU, where the trainer shares them with the
    inference server and the runners; torch's default on a GPU)."""
    task_runner: Literal["default", "processes", "ray"] = "default"
    """default: runner tasks on threads of the flow's process, their agents too; processes: the tasks on threads, each
    task's runners and agents in a process of the run's own (another interpreter, another core:
    `lightning.runner.processes`); ray: prefect-ray's RayTaskRunner."""
    ray_address: str | None = None
    """The Ray cluster (ray://host:10001 or auto) for task_runner ray and the verl backend; None: a local one."""
    seed: int = 0
    """Seeds the tiny model, the order tasks are drawn in, and every sampled completion (each rollout's seed derives
    from it, its iteration, task and sample; each LLM call's from that and its turn). The update has
    `algorithm.seed`."""
    deterministic: bool = False
    """The same config and seed give the same run: the embedded inference server decodes each sequence on its own
    (batch-invariant: its tokens do not depend on which requests share a batch), vLLM runs its batch-invariant mode
    (VLLM_BATCH_INVARIANT, GPU), and the trainer uses torch's deterministic algorithms. It costs the server's
    batching: on the demo, a 10-iteration run took 1.15 times as long (docs/benchmarks.md). Off, every completion is
    still seeded, and runs drift apart only through batch numerics (none measured on the demo on a CPU)."""
    apo: ApoConfig | None = None
    """Prompt optimisation by the `optimize_prompt` flow (None: none). When set, every flow's rollouts also get
    the seed prompt as the PromptTemplate resource `apo.resource_name`."""
    llm_resource_name: str = Field(default="main_llm", min_length=1)
    """The name of the run's LLM (the policy, reached through the run's proxy) in the rollouts' resources."""
    resources: dict[str, StaticResource] = Field(default_factory=dict)
    """Named resources every rollout gets beside the run's LLM, as they are (agent-lightning's `initial_resources`):
    prompt templates, and LLMs the agent calls directly (not trained; their key, if any, comes from the agent's own
    environment, never from here). Each is `{resource_type: prompt_template, template: ..., engine: f-string}` or
    `{resource_type: llm, endpoint: ..., model: ...}`."""

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        return _matching(
            RUN_NAME, value, "use letters, digits, '.', '_' and '-' (at most 100, starting with a letter or digit)"
        )

    @field_validator("agent")
    @classmethod
    def _agent(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return _matching(
            ENTRY_POINT,
            value,
            "give the agent as module:function or module:Class, e.g. examples.copy_task.agent:copy_agent",
        )

    @field_validator("sampling", "eval_sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        SamplingParameters.check(value)
        return value

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: str) -> str:
        scheme = value.partition("://")[0].split("+", 1)[0].lower()
        if scheme not in ("sqlite", "postgresql", "postgres", "http", "https") or "://" not in value:
            raise ValueError(
                "give sqlite:///path.db, postgresql://user@host/db (a password as ${ENV_VAR}), or the http:// URL "
                "of a store server"
            )
        return value

    @field_validator("train_data", "val_data")
    @classmethod
    def _data(cls, value: str | None) -> str | None:
        if value is None or ENTRY_POINT.match(value) or Path(value).suffix in (".jsonl", ".parquet"):
            return value
        raise ValueError("give a .jsonl or .parquet file, or module:function returning a list of tasks")

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, resource in value.items():
            if isinstance(resource, LLM) and resource.api_key:
                raise ValueError(
                    f"{name}: an LLM here may not hold an api_key (the store would keep it); let the agent read its "
                    "key from its environment"
                )
        return value

    @model_validator(mode="after")
    def _resource_names(self) -> TrainConfig:
        taken = {self.llm_resource_name: "llm_resource_name"}
        if self.apo is not None:
            taken[self.apo.resource_name] = "apo.resource_name"
        for name in self.resources:
            if name in taken:
                raise ValueError(f"resources.{name}: the name is the run's own ({taken[name]}); give another")
        return self

    @model_validator(mode="after")
    def _backend_combinations(self) -> TrainConfig:
        if self.trainer_backend == "verl" and self.warm_start is not None:
            raise ValueError(
                "warm_start: the verl backend has no supervised step; remove warm_start, or run it with "
                "trainer_backend torch and give that run's checkpoint as `model`"
            )
        if not is_loopback(self.proxy_host) and self.inference.backend == "embedded":
            raise ValueError("proxy_host: the embedded inference server's proxy stays on 127.0.0.1; use vllm")
        if self.proxy_any_agent_key and not is_loopback(self.proxy_host):
            raise ValueError(
                f"proxy_any_agent_key: only for a proxy on loopback; on {self.proxy_host} every call must carry the "
                "token, so agents must send their LLM's api_key"
            )
        problem = ray_store_problem(self.task_runner, self.store_url)
        if problem is not None:
            raise ValueError(f"store_url: {problem}")
        if self.task_runner == "processes" and in_memory_sqlite(self.store_url):
            raise ValueError(
                f"store_url: {self.store_url!r} is an in-memory SQLite store, which the runner processes of "
                "task_runner 'processes' cannot see; give a SQLite file (the default), postgresql:// or an http:// "
                "store server, or use task_runner 'default'"
            )
        uses_sampler = self.algorithm.old_log_probs == "sampler" or self.algorithm.off_policy_correction != "none"
        temperature = self.update_config.scoring_temperature
        if uses_sampler and temperature != 1.0:
            raise ValueError(
                "algorithm.temperature: the sampler's stored log-probs (old_log_probs 'sampler', "
                "off_policy_correction) are the model's raw distribution's, at temperature 1, and the trainer's would "
                f"be at {temperature:g}; sample at temperature 1.0, or use old_log_probs 'trainer' "
                "and off_policy_correction 'none'"
            )
        if self.inference.with_proxy and self.proxy_in_process:
            raise ValueError(
                "inference.with_proxy: the proxy runs in the inference server's process, and proxy_in_process puts "
                "it in the flow's; choose one"
            )
        if self.inference.weight_sync == "sleep" and self.inference.backend != "vllm":
            raise ValueError("inference.weight_sync: 'sleep' needs inference.backend 'vllm'")
        if self.algorithm.lora is not None and self.inference.backend == "vllm" and self.inference.endpoint is None:
            self._check_lora_on_vllm(self.algorithm.lora.rank)
        if self.trainer_backend == "verl":
            if self.algorithm.device != "auto":
                raise ValueError(
                    "algorithm.device: the verl backend places its workers on the Ray cluster's GPUs itself; leave "
                    "it auto"
                )
            torch_only = {
                "pack_sequences": "verl.use_remove_padding", "gradient_checkpointing": "verl.gradient_checkpointing",
                "micro_batch_tokens": "verl.overrides (actor_rollout_ref.actor.ppo_max_token_len_per_gpu)",
                "logit_chunk_tokens": None, "bf16_weights": None,
            }  # fmt: skip
            for name, instead in torch_only.items():
                if getattr(self.algorithm, name) not in (None, False):
                    fix = f"verl's own is {instead}" if instead else "verl has no such option"
                    raise ValueError(f"algorithm.{name}: an option of the torch trainer; {fix}")
            if self.algorithm.off_policy_correction != "none":
                raise ValueError("algorithm.off_policy_correction: an option of the torch trainer; verl has none here")
        return self

    def _check_lora_on_vllm(self, rank: int) -> None:
        """A LoRA run's vLLM replicas serve each checkpoint's adapter (`Run.load_weights`): what must hold for them."""
        from lightning.inference.vllm import VLLM_LORA_RANKS

        if self.trainer_backend == "verl":
            raise ValueError(
                "algorithm.lora: the run hot-swaps the torch trainer's LoRA checkpoints (peft adapters) into its vLLM "
                "replicas; what verl's LoRA export holds has not been run here: use trainer_backend torch, or full "
                "fine-tuning with verl"
            )
        if rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"algorithm.lora.rank: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most")
        options = self.inference.vllm
        if options.get("enable_lora") is False:
            raise ValueError("inference.vllm.enable_lora: a LoRA run's vLLM replicas serve its adapters; leave it on")
        chosen = options.get("max_lora_rank")
        if chosen is not None and (chosen < rank or chosen not in VLLM_LORA_RANKS):
            raise ValueError(
                f"inference.vllm.max_lora_rank: {chosen} cannot serve adapters of rank {rank} (algorithm.lora.rank); "
                f"give one of {', '.join(map(str, VLLM_LORA_RANKS))} of at least {rank}, or leave it out"
            )

    @property
    def failed_groups_kept(self) -> int:
        """Dynamic sampling's `keep_failed_groups`, where they carry an advantage (else they would only dilute the
        update: none are kept)."""
        return self.keep_failed_groups if self.algorithm.failed_group_advantage else 0

    @property
    def update_config(self) -> TrainerConfig:
        """`algorithm` as the trainer takes it: a cosine schedule without `total_steps` spans the run's
        iterations (one update each); without `temperature`, the log-probs are the sampling temperature's."""
        update: dict[str, Any] = {}
        if self.algorithm.lr_schedule == "cosine" and self.algorithm.total_steps is None:
            update["total_steps"] = self.iterations
        if self.algorithm.temperature is None:
            update["temperature"] = sampling_temperature(self.sampling)
        return self.algorithm.model_copy(update=update) if update else self.algorithm

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name


def in_memory_sqlite(url: str) -> bool:
    """Whether `url` names an in-memory SQLite store (seen by the process that opens it, no other)."""
    scheme, _, rest = url.partition("://")
    if scheme.split("+", 1)[0] != "sqlite":
        return False
    return rest.removeprefix("/").split("?", 1)[0] in ("", ":memory:") or "mode=memory" in rest


def ray_store_problem(task_runner: str, store_url: str) -> str | None:
    """Why runner tasks on Ray workers could not reach the run's store (None: nothing known against it). The
    workers are other processes, with their own working directory: an in-memory SQLite store is not theirs to
    see, and a relative SQLite path names another file for them. (An absolute SQLite path is reachable only
    from the flow's machine: a cluster of several nodes needs a PostgreSQL or store-server URL.)"""
    if task_runner != "ray":
        return None
    url = store_url
    scheme, _, rest = url.partition("://")
    if scheme.split("+", 1)[0] != "sqlite":
        return None
    fix = (
        "Ray workers are other processes (on other machines): give a store they can reach, an http:// store "
        "server (`lightning store serve`, token in $LIGHTNING_STORE_TOKEN) or postgresql://, or at least an "
        "absolute SQLite path on a single-machine cluster"
    )
    path = rest.removeprefix("/").split("?", 1)[0]
    if in_memory_sqlite(url):
        return f"store_url {url!r} is an in-memory SQLite store, which only the flow's process sees. {fix}"
    if not path.startswith("/"):
        return (
            f"store_url {url!r} is a relative SQLite path, which each Ray worker resolves against its own "
            f"working directory. {fix}"
        )
    return None


def sampling_temperature(sampling: dict[str, Any]) -> float:
    """The temperature a `sampling` dict draws at: the OpenAI default 1.0 when unset; 1.0 for greedy (0), whose
    samples carry no temperature to match."""
    value = sampling.get("temperature")
    return float(value) if isinstance(value, int | float) and value > 0 else 1.0


def load_config(source: str | Path | dict[str, Any], **overrides: Any) -> TrainConfig:
    """A TrainConfig from a YAML file or a dict, with dotted overrides (`{"algorithm.lr": 1e-4}`)."""
    if isinstance(source, dict):
        data, where = source, "the configuration"
    else:
        data, where = read_config_file(source), str(source)
    return validate_config(apply_overrides(data, overrides), where, overridden=overrides)


def with_overrides(config: TrainConfig | dict[str, Any], overrides: dict[str, Any] | None) -> TrainConfig:
    """`config` with dotted overrides (`{"iterations": 3, "algorithm.lr": 1e-4}`) applied: the flows' `overrides`
    parameter, so a deployment run changes a few fields of the deployment's config instead of replacing it whole."""
    base = config.model_dump() if isinstance(config, TrainConfig) else dict(config)
    if not overrides:
        return validate_config(base)
    if not isinstance(overrides, dict) or not all(isinstance(key, str) for key in overrides):
        raise ConfigError('overrides: give a mapping of dotted field names to values, e.g. {"iterations": 3}')
    return load_config(base, **overrides)


def validate_config(
    data: dict[str, Any] | TrainConfig, where: str = "the configuration", overridden: Collection[str] = ()
) -> TrainConfig:
    """`data` as a TrainConfig, or a ConfigError naming each bad field; one that an override in `overridden` set
    (`--set`, a flow's `overrides`) is said to come from it, not from `where`."""
    if isinstance(data, TrainConfig):
        return data
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        given = f"{where} with its overrides" if overridden else where
        raise ConfigError(f"{given} is not a valid TrainConfig:\n{describe_errors(exc, overridden)}") from None


def describe_errors(exc: ValidationError, overridden: Collection[str] = ()) -> str:
    """One line per problem: the dotted field, what is wrong, what was given (and the override that gave it)."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        override = next((name for name in overridden if f"{field}.".startswith(f"{name}.")), None)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = (
                "unknown field; check its spelling against TrainConfig (`lightning config defaults` prints every field)"
            )
        given = "" if error["type"] in ("missing", "extra_forbidden", UNKNOWN_KEY) else f" (got {error.get('input')!r})"
        source = f" (set by the override {override})" if override else ""
        lines.append(f"  {field}: {message}{given}{source}")
    return "\n".join(lines)


def load_entry_point(spec: str, field: str) -> Any:
    """The object named by `module:attr`; the error names the config field it came from."""
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def missing_data(field: str) -> str:
    """The error for a run without `train_data` (or a stage that needs `val_data` without it): the field and its
    forms."""
    kind = "training" if field == "train_data" else "held-out"
    return (
        f"{field}: not set; give the {kind} tasks as a .jsonl or .parquet file (one task per row) or as "
        f"module:function returning a list, e.g. `{field}: examples/first_agent/{field.split('_')[0]}.jsonl`"
    )


def load_tasks(spec: str, field: str = "train_data") -> list[Any]:
    """The tasks of a dataset field: JSONL and Parquet rows, or what an entry point returns."""
    path = Path(spec)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ConfigError(f"{field}: no file {path}")
        tasks = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    tasks.append(json.loads(line))
                except ValueError as exc:
                    raise ConfigError(f"{field}: {path} line {number} is not JSON: {exc}") from exc
    elif path.suffix == ".parquet":
        if not path.is_file():
            raise ConfigError(f"{field}: no file {path}")
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(f"{field}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
        tasks = pq.read_table(path).to_pylist()
    else:
        function: Callable[[], Any] = load_entry_point(spec, field)
        if not callable(function):
            raise ConfigError(f"{field}: {spec} is not a function")
        tasks = list(function())
    if not tasks:
        raise ConfigError(f"{field}: {spec} holds no tasks")
    return tasks


def load_agent(spec: str | None) -> Any:
    """The agent of the `agent` field as a LitAgent (a @rollout function is one already; a class is instantiated)."""
    if spec is None:
        raise ConfigError(
            "agent: not set; name the agent to train as `agent: module:function` (a @rollout function) or "
            "`module:Class` (a LitAgent subclass), e.g. examples.copy_task.agent:copy_agent"
        )
    target = load_entry_point(spec, "agent")
    if isinstance(target, type) and issubclass(target, LitAgent):
        target = target()
    if not isinstance(target, LitAgent):
        raise ConfigError(
            f"agent: {spec} is a {type(target).__name__}, not an agent; decorate the function with "
            "@lightning.agent.rollout or subclass lightning.agent.LitAgent"
        )
    return target


def __getattr__(name: str) -> Any:
    missing(__name__, name)
