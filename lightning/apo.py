"""Automatic prompt optimisation (APO): beam search over a prompt template by textual gradients (ProTeGi: Pryzant et
al., 2023, "Automatic Prompt Optimization with 'Gradient Descent' and Beam Search"), on the run's own rollout
machinery. Its parameters are `TrainConfig.apo` (`lightning.config.ApoConfig`).

    one round   1. run every prompt of the beam on a batch of training tasks
                2. ask the optimiser model to critique each prompt from its lowest-reward transcripts (the gradient)
                3. ask it for `branch_factor` edited prompts per critique
                4. score the new prompts (and the beam's unscored ones) on the validation batch
                5. keep the best `beam_width`

A candidate prompt is a resources version of the store: the run's LLM (through its proxy, so every call is a span)
beside the candidate as the PromptTemplate resource. Its rollouts are enqueued in the run's queue with idempotency
keys naming the candidate and the task, and the run's runners run them: a candidate scored on a validation task
once is never run on it again (a later round, a retried flow run). The optimiser is any LiteLLM model.

Each step is a plain async function of the open run, like `lightning.stages`; the `optimize_prompt` flow
(flows/optimize_prompt.py) runs them as Prefect tasks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import re
import string
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from lightning.adapter import spans_to_messages
from lightning.config import ApoConfig, TrainConfig
from lightning.environment import litellm_offline
from lightning.errors import ConfigError
from lightning.run import Run
from lightning.stages import Mode, run_resources, summarize_rollouts
from lightning.tracing import find_final_reward
from lightning.types import EnqueueRolloutRequest, PromptTemplate

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 2000
"""Each message of a transcript shown to the optimiser is cut to this many characters."""
OPTIMIZER_TIMEOUT = 300.0
"""Seconds one optimiser call may take."""


class Candidate(BaseModel):
    """A prompt of the search: its text, where it came from, how it scored."""

    id: str
    """`p-` and the first 12 hex digits of the text's SHA-256: the same text is the same candidate."""
    template: str
    parent: str | None = None
    round: int = -1
    """The round that proposed it (-1: the seed)."""
    train_reward: float | None = None
    """Mean reward on the latest training batch it ran on (as a member of the beam)."""
    val_reward: float | None = None
    """Mean reward on the validation batch."""


def candidate(template: str, parent: str | None = None, round_: int = -1) -> Candidate:
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    return Candidate(id=f"p-{digest}", template=template, parent=parent, round=round_)


def apo_config(config: TrainConfig) -> ApoConfig:
    """The run's APO settings; a ConfigError naming the field when prompt optimisation cannot run."""
    if config.apo is None:
        raise ConfigError(
            "apo: prompt optimisation needs an `apo` section: at least the seed prompt (apo.initial_prompt or "
            "apo.initial_prompt_from) and the optimiser models (apo.gradient_model, apo.apply_edit_model)"
        )
    if config.val_data is None:
        raise ConfigError("val_data: prompt optimisation scores every candidate on held-out tasks; give val_data")
    apo = config.apo
    if apo.api_key_env and not os.environ.get(apo.api_key_env):
        raise ConfigError(
            f"apo.api_key_env: the environment variable {apo.api_key_env} (the optimiser's key) is not set"
        )
    placeholders(apo.seed())  # a template that does not parse is an error here, not in the first rollout
    return apo


def seed_candidate(config: TrainConfig) -> Candidate:
    return candidate(apo_config(config).seed().template)


# --- 1 and 4: evaluating candidates with the run's rollouts ----------------------------------------------------


def candidate_resources_id(run: Run, candidate_id: str, mode: Mode) -> str:
    """One resources id per (run, candidate, mode), updated in place: rollouts enqueued by an earlier process of the
    run reach this process's proxy."""
    digest = hashlib.sha256(f"{run.name}/{candidate_id}/{mode}".encode()).hexdigest()[:24]
    return f"rs-apo-{digest}-{mode}"


async def publish_candidates(run: Run, candidates: Sequence[Candidate], mode: Mode) -> dict[str, str]:
    """Each candidate as a resources version: the run's LLM with the mode's sampling parameters (train: `sampling`,
    val: `eval_sampling`) and the candidate as the PromptTemplate resource; candidate id -> resources id."""
    apo = apo_config(run.config)
    published = {}
    for each in candidates:
        prompt = PromptTemplate(template=each.template, engine=apo.prompt_engine)
        resources = run_resources(run, mode, {apo.resource_name: prompt})
        update = await run.store.update_resources(candidate_resources_id(run, each.id, mode), resources)
        published[each.id] = update.resources_id
    run.made_progress(f"publish_candidates ({mode})")
    return published


def batch(run: Run, mode: Mode, round_: int) -> list[tuple[int, Any]]:
    """(index, task) pairs. train: round `round_`'s `gradient_batch_size` training tasks, epochs over the shuffled
    dataset; val: the first `val_batch_size` of the shuffled validation tasks, the same every round."""
    config, apo = run.config, apo_config(run.config)
    tasks = run.dataset("train_data" if mode == "train" else "val_data")
    if mode == "val":
        order = list(range(len(tasks)))
        random.Random(f"{config.seed}/apo-val").shuffle(order)
        return [(index, tasks[index]) for index in order[: apo.val_batch_size]]
    chosen = []
    for position in range(round_ * apo.gradient_batch_size, (round_ + 1) * apo.gradient_batch_size):
        epoch, at = divmod(position, len(tasks))
        order = list(range(len(tasks)))
        random.Random(f"{config.seed}/apo/{epoch}").shuffle(order)
        chosen.append((order[at], tasks[order[at]]))
    return chosen


async def enqueue_candidates(run: Run, round_: int, resources: dict[str, str], mode: Mode) -> dict[str, list[str]]:
    """Each candidate's rollouts on the mode's batch, in the run's queue; candidate id -> rollout ids. Keys name the
    candidate and the task (and the round, for training batches): enqueued before, the same rollouts come back."""
    requests, owners = [], []
    for candidate_id, resources_id in resources.items():
        for index, task in batch(run, mode, round_):
            where = f"{round_}/{index}" if mode == "train" else str(index)
            metadata = {"run_name": run.name, "iteration": round_, "task_index": index, "candidate": candidate_id}
            requests.append(
                EnqueueRolloutRequest(
                    input=task,
                    mode=mode,
                    resources_id=resources_id,
                    config=run.config.rollout,
                    metadata=metadata,
                    idempotency_key=f"{run.queue}/apo/{mode}/{candidate_id}/{where}",
                    queue=run.queue,
                )  # fmt: skip
            )
            owners.append(candidate_id)
    enqueued = await run.store.enqueue_many_rollouts(requests)
    by_candidate: dict[str, list[str]] = {candidate_id: [] for candidate_id in resources}
    for owner, rollout in zip(owners, enqueued, strict=True):
        by_candidate[owner].append(rollout.rollout_id)
    run.made_progress(f"enqueue_candidates ({mode} {round_})")
    return by_candidate


async def score_candidates(
    run: Run, candidates: Sequence[Candidate], rollouts: dict[str, list[str]], mode: Mode
) -> list[Candidate]:
    """The candidates with their mean reward on the mode's batch (NaN: none of their rollouts has a reward)."""
    field = "train_reward" if mode == "train" else "val_reward"
    scored = []
    for each in candidates:
        summary = await summarize_rollouts(run.store, rollouts[each.id])
        scored.append(each.model_copy(update={field: summary["reward_mean"]}))
    return scored


# --- 2: the textual gradient ------------------------------------------------------------------------------


async def lowest_reward_transcripts(run: Run, rollout_ids: Sequence[str], limit: int) -> list[dict[str, Any]]:
    """The `limit` rollouts with the lowest reward (none: lowest of all), each as its task, its last LLM call's
    messages (the conversation up to the answer) and its reward."""
    examples = []
    for rollout_id in rollout_ids:
        spans = await run.store.query_spans(rollout_id, "latest")
        rollout = await run.store.get_rollout_by_id(rollout_id)
        transcripts = spans_to_messages(spans, reward_match="final")
        messages = transcripts[-1].messages if transcripts else []
        task = rollout.input if rollout is not None else None
        examples.append({"task": task, "messages": messages, "reward": find_final_reward(spans)})
    examples.sort(key=lambda example: -math.inf if example["reward"] is None else example["reward"])
    return examples[:limit]


def critique_messages(template: str, examples: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The request for a critique: the prompt, then its worst runs (task, conversation, reward)."""
    runs = []
    for number, example in enumerate(examples, 1):
        reward = "none (the run failed)" if example["reward"] is None else f"{example['reward']:g}"
        task = json.dumps(example["task"], default=str)[:MAX_MESSAGE_CHARS]
        conversation = "\n".join(
            f"[{message.get('role', '?')}] {_text(message)[:MAX_MESSAGE_CHARS]}" for message in example["messages"]
        )
        runs.append(f"### Run {number}: reward {reward}\nTask: {task}\n{conversation or '(no model call recorded)'}")
    return [
        {"role": "system", "content": "You improve the prompts of AI agents by studying the runs where they failed."},
        {
            "role": "user",
            "content": (
                "An agent ran with this prompt template (its placeholders are filled in for each task):\n"
                f"<prompt>\n{template}\n</prompt>\n\nThese are its runs with the lowest reward (higher is better):\n\n"
                + "\n\n".join(runs)
                + "\n\nGive the reasons why the prompt led to these results, one per line, each saying what the "
                "prompt should say instead. Do not rewrite the prompt yet."
            ),
        },
    ]


async def critique(run: Run, beam_member: Candidate, rollout_ids: Sequence[str]) -> str:
    """Step 2 for one prompt of the beam: the optimiser's critique of its lowest-reward transcripts."""
    apo = apo_config(run.config)
    examples = await lowest_reward_transcripts(run, rollout_ids, apo.gradient_batch_size)
    answer = await ask_optimizer(apo, apo.gradient_model, critique_messages(beam_member.template, examples))
    run.made_progress(f"critique of {beam_member.id}")
    return answer.strip()


# --- 3: edits ------------------------------------------------------------------------------------------------


def edit_messages(template: str, critique_text: str, variant: int, branch_factor: int) -> list[dict[str, str]]:
    """The request for edited prompt `variant` (1-based) of `branch_factor`."""
    names = ", ".join(sorted(placeholder_names(template))) or "none"
    return [
        {"role": "system", "content": "You rewrite the prompts of AI agents to fix the faults a critique names."},
        {
            "role": "user",
            "content": (
                f"The prompt template:\n<prompt>\n{template}\n</prompt>\n\nA critique of it, from runs where it got "
                f"low reward:\n<critique>\n{critique_text}\n</critique>\n\nWrite an improved prompt template that "
                f"fixes what the critique names. Keep every placeholder exactly as written (placeholders: {names}) "
                f"and add no new ones. This is variant {variant} of {branch_factor}: make it differ from the "
                "others. Answer with the new template alone between <prompt> and </prompt>."
            ),
        },
    ]


async def propose_edit(run: Run, round_: int, parent: Candidate, critique_text: str, variant: int) -> Candidate | None:
    """Step 3, one edit: the optimiser's rewrite of `parent` from its critique, or None when the answer holds no
    prompt, or one whose placeholders differ from the parent's (the agent could not fill it in)."""
    apo = apo_config(run.config)
    messages = edit_messages(parent.template, critique_text, variant, apo.branch_factor)
    answer = await ask_optimizer(apo, apo.apply_edit_model, messages)
    run.made_progress(f"edit {variant} of {parent.id}")
    text = extract_prompt(answer)
    engine = apo.prompt_engine
    if text is None:
        logger.warning("round %d: edit %d of %s holds no <prompt>...</prompt>; dropped", round_, variant, parent.id)
        return None
    try:
        same = placeholders(PromptTemplate(template=text, engine=engine)) == placeholders(
            PromptTemplate(template=parent.template, engine=engine)
        )
    except ValueError as exc:
        logger.warning("round %d: edit %d of %s does not parse (%s); dropped", round_, variant, parent.id, exc)
        return None
    if not same:
        logger.warning("round %d: edit %d of %s changed the placeholders; dropped", round_, variant, parent.id)
        return None
    return candidate(text, parent=parent.id, round_=round_)


def extract_prompt(answer: str) -> str | None:
    """The text between the last <prompt> and </prompt> (a model may quote the old prompt first), stripped."""
    found = re.findall(r"<prompt>\s*(.*?)\s*</prompt>", answer, flags=re.DOTALL)
    return found[-1] if found and found[-1].strip() else None


def placeholders(prompt: PromptTemplate) -> set[str]:
    """The names a template fills in; ValueError when it does not parse."""
    if prompt.engine == "f-string":
        return placeholder_names(prompt.template)
    import jinja2
    import jinja2.meta

    try:
        return set(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(prompt.template)))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"not a Jinja2 template: {exc}") from exc


def placeholder_names(template: str) -> set[str]:
    """The fields of an f-string template (`{name}`, `{name.attr}` -> name); ValueError on a stray brace."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.add(re.split(r"[.\[]", field, maxsplit=1)[0])
    return names


# --- 5: selection ------------------------------------------------------------------------------------------


def select_beam(candidates: Sequence[Candidate], beam_width: int) -> list[Candidate]:
    """The `beam_width` best by validation reward (no reward counts as the lowest); ties keep the older prompt."""
    unique = list({each.id: each for each in candidates}.values())

    def rank(each: Candidate) -> tuple[float, int]:
        reward = each.val_reward if each.val_reward is not None and each.val_reward == each.val_reward else -math.inf
        return (-reward, each.round)

    return sorted(unique, key=rank)[:beam_width]


def new_candidates(beam: Sequence[Candidate], proposed: Sequence[Candidate | None]) -> list[Candidate]:
    """The proposed prompts that are neither dropped (None) nor already known, each once."""
    seen = {each.id for each in beam}
    fresh = []
    for each in proposed:
        if each is not None and each.id not in seen:
            seen.add(each.id)
            fresh.append(each)
    return fresh


def with_scores(candidates: Sequence[Candidate], scored: Sequence[Candidate]) -> list[Candidate]:
    """`candidates`, each replaced by its scored version where `scored` has one."""
    by_id = {each.id: each for each in scored}
    return [by_id.get(each.id, each) for each in candidates]


# --- the optimiser ---------------------------------------------------------------------------------------------


async def ask_optimizer(apo: ApoConfig, model: str, messages: list[dict[str, str]]) -> str:
    """One chat completion from the optimiser through LiteLLM (any provider); its text. The call runs on one event
    loop of the process's own (`_litellm_loop`): LiteLLM keeps its HTTP clients across calls, and each belongs to
    the loop that made it, while Prefect runs each task on a loop of its own."""
    api_key = os.environ.get(apo.api_key_env) if apo.api_key_env else None

    async def call() -> str:
        import litellm

        response = await litellm.acompletion(
            model=model, messages=messages, api_base=apo.api_base, api_key=api_key,
            temperature=apo.diversity_temperature, drop_params=True, timeout=OPTIMIZER_TIMEOUT, num_retries=2,
        )  # fmt: skip
        return response.choices[0].message.content or ""

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), _litellm_loop()))


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _litellm_loop() -> asyncio.AbstractEventLoop:
    """The event loop of the optimiser's calls, on a daemon thread started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            litellm_offline()
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="apo-optimizer-calls", daemon=True).start()
        return _loop


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    calls = message.get("tool_calls")
    if calls:
        content = f"{content or ''} (tool calls: {json.dumps(calls, default=str)})"
    return str(content or "")


# --- MLflow: metrics, candidates, the registry -----------------------------------------------------------


def log_round(run: Run, round_: int, scored: Sequence[Candidate], beam: Sequence[Candidate]) -> dict[str, Any]:
    """Round `round_` in MLflow: the best validation reward of the new beam and the mean over every candidate the
    round scored, as metrics at step `round_`; each candidate's text as an artifact
    `apo/round-<r>/<candidate>.txt`, and the round's table as `apo/round-<r>.json`."""
    rewards = [each.val_reward for each in scored if each.val_reward is not None and each.val_reward == each.val_reward]
    best = beam[0].val_reward if beam and beam[0].val_reward is not None else float("nan")
    metrics = {
        "val_reward_best": best,
        "val_reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "candidates": len(scored),
    }
    tracker = run.tracker
    if tracker is not None:
        tracker.log_metrics({"apo": metrics}, round_)
        folder = f"apo/round-{round_:02d}"
        for each in scored:
            tracker.client.log_text(tracker.run_id, each.template, f"{folder}/{each.id}.txt")
        kept = {each.id for each in beam}
        table = [{**each.model_dump(), "kept": each.id in kept} for each in scored]
        tracker.client.log_text(tracker.run_id, json.dumps(table, indent=2), f"{folder}.json")
    return metrics


def mlflow_template(prompt: PromptTemplate) -> str:
    """The template in MLflow's prompt syntax ({{ name }}): an f-string's fields become {{name}} (MLflow's
    `PromptVersion.to_single_brace_format()` gives the f-string back); Jinja2 templates are MLflow's already."""
    if prompt.engine == "jinja":
        return prompt.template
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(prompt.template):
        parts.append(literal)
        if field is not None:
            if spec or conversion or not re.fullmatch(r"[A-Za-z_]\w*", field):
                return prompt.template  # not MLflow's syntax; kept as written (engine tag: f-string)
            parts.append("{{" + field + "}}")
    return "".join(parts)


def register_prompt(run: Run, best: Candidate) -> dict[str, Any]:
    """The best prompt as a new version in MLflow's prompt registry (`apo.prompt_name`, default the run's name),
    with its validation reward and the MLflow run as lineage (the version is linked to the run, and the run's tag
    `apo.best_prompt` holds the version's URI). Load it with `mlflow.genai.load_prompt("prompts:/<name>/<v>")`."""
    apo = apo_config(run.config)
    tracker = run.tracker
    name = apo.prompt_name or run.name
    prompt = PromptTemplate(template=best.template, engine=apo.prompt_engine)
    score = best.val_reward if best.val_reward is not None else float("nan")
    tags = {
        "val_reward": f"{score:.6g}",
        "lightning.run_name": run.name,
        "lightning.mlflow_run_id": str(tracker.run_id),
        "lightning.candidate": best.id,
        "lightning.prompt_engine": apo.prompt_engine,
    }
    version = tracker.client.register_prompt(
        name=name, template=mlflow_template(prompt), tags=tags,
        commit_message=f"APO run {run.name}: validation reward {score:.3f} ({best.id})",
    )  # fmt: skip
    _link_to_run(tracker.client, tracker.run_id, version)
    uri = f"prompts:/{name}/{version.version}"
    tracker.client.set_tag(tracker.run_id, "apo.best_prompt", uri)
    return {"name": name, "version": int(version.version), "uri": uri, "val_reward": score}


def _link_to_run(client: Any, run_id: str, version: Any) -> None:
    """MLflow's `link_prompt_version_to_run` (the run's `mlflow.linkedPrompts` tag, which the UI shows), on this
    client's stores: MLflow 3.17's own reads the run from the process-wide tracking URI, not the client's."""
    from mlflow.tracing.constant import TraceTagKey
    from mlflow.tracing.utils.prompt import update_linked_prompts_tag

    current = client.get_run(run_id).data.tags.get(TraceTagKey.LINKED_PROMPTS)
    updated = update_linked_prompts_tag(current, [version])
    if updated != current:
        client.set_tag(run_id, TraceTagKey.LINKED_PROMPTS, updated)
