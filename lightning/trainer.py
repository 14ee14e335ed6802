"""agent-lightning's `Trainer`, over this project's flows: `Trainer(...).fit(agent, train_dataset, val_dataset=...)`
builds a `TrainConfig` and runs the `train` flow on it; `.dev(...)` runs the `dev` flow (one batch of rollouts,
adapted, nothing trained). It is a facade, not a second pipeline: what a run does is what `python -m flows.train`
does with the same config.

This is the one place where the library hands off to the flows: `fit` and `dev` call the runner that the flow layer
registers under the `lightning.flows` entry point (`flows.handoff:run_flow`), so the library never imports Prefect or
the flows. Without PREFECT_API_URL the flow runs on a temporary Prefect server of its own, as on the command line.

The flows name the agent and the datasets as `module:attr` entry points. An agent that its module holds under a
name (not `__main__`) is named so; any other agent object is put in this process's `registry` and named
`lightning.trainer:registry.<name>`, which only runner tasks on threads of this process (task_runner `default`)
can reach. Datasets in memory are written to JSONL in the run directory (rollout inputs are JSON in the store
anyway); a string is taken as the path or entry point it names.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import json
import os
import re
import sys
import types
from collections.abc import Awaitable, Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from lightning import preflight
from lightning.adapter import (
    LlmProxyTraceToTriplet,
    TraceAdapter,
    TracerTraceToTriplet,
    TraceToMessages,
    TraceToTripletBase,
)
from lightning.agent import FunctionalLitAgent, LitAgent
from lightning.agl_algorithms import APO, VERL, Algorithm, FastAlgorithm
from lightning.agl_execution import ClientServerExecutionStrategy, as_strategy
from lightning.agl_import_paths import missing
from lightning.algorithm.config import TrainerConfig
from lightning.config import TrainConfig, load_config, load_entry_point, validate_config
from lightning.credentials import REFERENCE, split_credentials
from lightning.env_var import LightningEnvVar, resolve_str_env_var
from lightning.environment import STORE_TOKEN
from lightning.errors import ConfigError
from lightning.serving import is_loopback
from lightning.tracing import Tracer
from lightning.types import LLM, Dataset, PromptTemplate, ProxyLLM

registry = types.SimpleNamespace()
"""Agents given to `fit` / `dev` that no module holds: `lightning.trainer:registry.<name>` (this process only)."""
REGISTRY_SPEC = "lightning.trainer:registry"
_ids = itertools.count(1)

# agent-lightning Trainer arguments that have no meaning here, and what to use instead.
_REFUSED = {
    "max_rollouts": "a run's runners stop when the iteration's rollouts are done; bound the work with iterations=, "
    "batch_size= and samples_per_task=",
    "max_tasks": "a run's runners stop when the iteration's rollouts are done; bound the work with iterations=, "
    "batch_size= and samples_per_task=",
    "triplet_exporter": "agent-lightning's deprecated name for adapter=: give adapter=TracerTraceToTriplet(...) (or "
    "leave it out), or choose the rows' shape with adapter_shape='transition' or 'trajectory'",
    "runner": "the run starts its runners; size them with n_runners= and runner_concurrency=",
    "port": "runners reach the store directly; to serve it over HTTP run `lightning store serve` and give "
    "store='http://host:port'",
    "hooks": "hooks are not passed to a run's runners; use lightning.runner.Runner(agent, store, hooks=[...]) directly",
}


class Trainer:
    """`Trainer(n_runners=2, algorithm={"lr": 1e-4}, iterations=3, batch_size=8).fit(agent, train, val_dataset=val)`.

    Keywords: agent-lightning's `n_runners` (`n_workers`: as agl's runners, each runs one rollout at a time unless
    `runner_concurrency` is given), `algorithm` (a `TrainerConfig` or a dict of its fields;
    or agl's `VERL(config)`, `APO(client, ...)`, an `Algorithm` / `@algo` function: lightning.agl_algorithms),
    `store` (a store URL, or an HttpLightningStore), `initial_resources` (named LLMs and prompt templates: the LLM
    to train is the endpoint rollouts use, as inference backend `external`; the rest reach every rollout as they
    are), `adapter` (agl's TracerTraceToTriplet, LlmProxyTraceToTriplet or a dict of the former's options: checked
    against what a run trains on, lightning.adapter.agl_triplet; TraceToMessages or an adapter of your own with APO
    and custom algorithms, which read it), `tracer` (agl's OtelTracer() or AgentOpsTracer(): each runner records
    with one of its own into the run's store), `strategy` (agl's "shm" / "cs" or its strategy objects: they set
    task_runner and n_runners, lightning.agl_execution); any `TrainConfig` field (run_name, iterations, model,
    batch_size, ...); and `config=` (a TrainConfig, a dict of its fields, or a YAML file) under them. The other
    agent-lightning arguments are refused with what to use instead."""

    def __init__(
        self,
        *,
        n_runners: int | None = None,
        n_workers: int | None = None,
        algorithm: TrainerConfig | Mapping[str, Any] | VERL | APO[Any] | Algorithm | None = None,
        store: Any = None,
        initial_resources: Mapping[str, Any] | None = None,
        adapter: Any = None,
        tracer: Any = None,
        strategy: Any = None,
        llm_proxy: Any = None,
        config: TrainConfig | Mapping[str, Any] | str | Path | None = None,
        dev: bool = False,
        daemon: bool = True,
        **fields: Any,
    ) -> None:
        refused = sorted(name for name in _REFUSED if fields.get(name) is not None)
        if refused:
            raise TypeError(
                "Trainer: " + "; ".join(f"{name}= is not supported here: {_REFUSED[name]}" for name in refused)
            )
        for name in _REFUSED:
            fields.pop(name, None)
        if dev:
            raise TypeError(
                "Trainer(dev=True) is agent-lightning's deprecated form; call Trainer(...).dev(agent, data)"
            )
        if not daemon:
            raise ValueError("Trainer(daemon=False): every process a run starts dies with it; leave daemon out")
        self._base = _base_config(config)
        self._fields: dict[str, Any] = dict(fields)
        if n_workers is not None and n_runners is not None and n_workers != n_runners:
            raise ValueError(f"Trainer: n_workers={n_workers} and n_runners={n_runners} disagree; give n_runners only")
        if n_runners is not None or n_workers is not None:
            self._fields["n_runners"] = n_runners if n_runners is not None else n_workers
        self.strategy = as_strategy(strategy, self._fields.get("n_runners")) if strategy is not None else None
        if self.strategy is not None:
            self._fields.update(self.strategy.trainer_fields())
        if "n_runners" in self._fields and "runner_concurrency" not in self._fields | self._base:
            # agl's runner runs one rollout at a time, so its `n_runners` is how many run at once. Ours would run
            # runner_concurrency (32) each: 320 for calc_x's n_runners=10, each rollout starting its own MCP server.
            self._fields["runner_concurrency"] = 1
        self.tracer = _tracer(tracer)
        self.adapter = _adapter(adapter)
        """agl's `trainer.adapter`: the adapter given (a dict: TracerTraceToTriplet of its options), else agl's
        default, TracerTraceToTriplet()."""
        self._verl = algorithm if isinstance(algorithm, VERL) else None
        self._apo = algorithm if isinstance(algorithm, APO) else None
        self._custom = algorithm if isinstance(algorithm, Algorithm) else None
        if algorithm is not None and not isinstance(algorithm, VERL | APO | Algorithm):
            self._fields["algorithm"] = _algorithm_fields(algorithm)
        if store is not None:
            self._fields["store_url"] = _store_url(store)
        self._initial_resources = dict(initial_resources) if initial_resources is not None else None
        if initial_resources is not None and self._custom is None:
            self._fields.update(_resource_fields(initial_resources))
        if self._apo is not None:
            self._fields["apo"] = _apo_section(self._apo, self._fields)
        self.llm_proxy = llm_proxy
        if llm_proxy is not None and self._custom is None:
            raise TypeError(
                "Trainer: llm_proxy= goes to a custom Algorithm (get_llm_proxy()); a run starts its own LLM proxy in "
                "front of its inference server (proxy_endpoint= to use one already running)"
            )
        if self._custom is None:
            self._fields.update(_adapter_fields(self.adapter, apo=self._apo is not None, given=adapter is not None))
        elif isinstance(self.strategy, ClientServerExecutionStrategy):
            raise ValueError(
                "Trainer: a custom Algorithm's runners run on this process's event loop beside it; give "
                "strategy='shm' (or none). To run runners in other processes, serve the store (`lightning store "
                "serve`), give store='http://host:port', and run lightning.Runner(agent, LightningStoreClient(url))"
                ".iter() there"
            )
        # a bad field fails here
        validate_config({**self._base, **self._verl_fields(None), **self._fields}, "Trainer's configuration")
        self.n_runners = self._fields.get("n_runners", self._base.get("n_runners", TrainConfig().n_runners))
        self.algorithm = self._fields.get("algorithm")
        self.config: TrainConfig | None = None
        """The TrainConfig of the last fit or dev."""

    # --- agent-lightning's entry points ---

    def fit(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> dict[str, Any]:
        """Train `agent` on `train_dataset` with the `train` flow; returns what the flow returns (the run's summary)."""
        return _run_sync(self.fit_async(agent, train_dataset, val_dataset=val_dataset), "fit")

    def dev(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> dict[str, Any]:
        """One batch of `train_dataset` rollouts through the `dev` flow, adapted to a training batch; nothing is
        trained. Unless batch_size or samples_per_task are given, the batch is each task once, as agent-lightning's
        `dev` runs them. Returns the flow's report (rollouts and batch); rollouts that leave nothing to train on (calls
        with the agent's own client, no reward) finish too, their batch of no rows saying why, where `fit` raises
        `NoTrainingRows`. `val_dataset` is accepted and unused."""
        return _run_sync(self.dev_async(agent, train_dataset, val_dataset=val_dataset), "dev")

    async def fit_async(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> Any:
        """`fit` for code already in an event loop."""
        return await self._run("train", agent, train_dataset, val_dataset)

    async def dev_async(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> Any:
        """`dev` for code already in an event loop."""
        return await self._run("dev", agent, train_dataset, val_dataset)

    # --- the config ---

    def build_config(
        self, agent: Any, train_dataset: Any = None, val_dataset: Any = None, *, one_pass: bool = False
    ) -> TrainConfig:
        """The TrainConfig that fit/dev run: the keywords over `config=`, with the agent and the datasets.
        `one_pass` (dev): unless batch_size or samples_per_task are given, each task of `train_dataset` runs once, as
        agent-lightning's `dev` runs them (its Baseline algorithm, one epoch)."""
        n_tasks = None if train_dataset is None or isinstance(train_dataset, str | Path) else len(train_dataset)
        data = {**self._base, **self._verl_fields(n_tasks), **self._fields}
        if one_pass and train_dataset is not None and not isinstance(train_dataset, str | Path):
            data.setdefault("batch_size", len(train_dataset))
            data.setdefault("samples_per_task", 1)
        # agent-lightning's agents send a key of their own ("dummy", their OPENAI_API_KEY) to the run's LLM proxy,
        # which serves them on loopback as agl's does (TrainConfig.proxy_any_agent_key) unless told otherwise.
        if is_loopback(str(data.get("proxy_host", TrainConfig.model_fields["proxy_host"].default))):
            data.setdefault("proxy_any_agent_key", True)
        agent_spec = _agent_spec(agent)
        data["agent"] = agent_spec
        data.setdefault("run_name", _run_name(agent))
        output_dir = Path(data.get("output_dir", TrainConfig().output_dir))
        data_dir = (output_dir / data["run_name"] / "data").resolve()
        if train_dataset is None and "train_data" not in self._base:
            raise ValueError("Trainer: give train_dataset (a list of tasks, a .jsonl/.parquet path or module:function)")
        if train_dataset is not None:
            data["train_data"] = _dataset_spec(train_dataset, "train_dataset", data_dir / "train.jsonl")
        if val_dataset is not None:
            data["val_data"] = _dataset_spec(val_dataset, "val_dataset", data_dir / "val.jsonl")
        elif "val_data" not in self._base:
            data["val_data"] = None
        config = validate_config(data, "Trainer's configuration")
        if config.task_runner in ("ray", "processes") and agent_spec.startswith(REGISTRY_SPEC):
            raise ValueError(
                f"Trainer: task_runner {config.task_runner!r} runs the agent in other processes, which cannot see "
                f"{type(agent).__name__} defined here; define it at the top level of an importable module (not the "
                "script you run), or use task_runner 'default'"
            )
        return config

    def _verl_fields(self, n_train_tasks: int | None) -> dict[str, Any]:
        return self._verl.run_fields(n_train_tasks) if self._verl is not None else {}

    async def _run(self, flow_name: str, agent: Any, train_dataset: Any, val_dataset: Any) -> Any:
        if not isinstance(agent, LitAgent):
            raise TypeError(
                f"Trainer: agent is a {type(agent).__name__}; give a LitAgent instance or a @lightning.rollout function"
            )
        role = resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE)
        if role not in (None, "", "both"):
            raise RuntimeError(
                f"Trainer: AGL_CURRENT_ROLE={role}: a run here starts its own runners beside its algorithm; unset it. "
                "To run runners on other machines, give task_runner='ray' (or 'processes'), or run "
                "lightning.Runner(agent, LightningStoreClient(url)).iter() there against `lightning store serve`"
            )
        if self._custom is not None:
            if flow_name != "train" and not isinstance(self._custom, FastAlgorithm):
                raise TypeError(
                    "Trainer.dev: a custom Algorithm runs with fit (dev runs a FastAlgorithm such as Baseline, or the "
                    "`dev` flow when no algorithm is given)"
                )
            return await self._run_algorithm(self._custom, agent, train_dataset, val_dataset)
        if self._verl is not None and (refusal := self._verl.refusal()) is not None:
            raise RuntimeError(refusal)
        if self._apo is not None and flow_name == "train":
            flow_name = "optimize_prompt"
        config = self.build_config(agent, train_dataset, val_dataset, one_pass=flow_name == "dev")
        preflight.check(config)
        run_flow = _flow_runner()
        agent.set_trainer(self)
        self.config = config
        return await run_flow(flow_name, config)

    async def _run_algorithm(self, algorithm: Algorithm, agent: Any, train_dataset: Any, val_dataset: Any) -> None:
        """agl's custom algorithm: `algorithm.run(train_dataset, val_dataset)` in this process against the store
        (`store=`, else one in memory; either answers unknown rollout ids as agl's stores do) while `n_runners`
        runners run `agent` on what it enqueues; they stop when it returns. No flow: nothing is trained but by the
        algorithm itself."""
        from lightning.runner import Runner
        from lightning.store import InMemoryLightningStore, open_store

        url = self._fields.get("store_url", self._base.get("store_url"))
        store = open_store(url, agl_answers=True) if url is not None else InMemoryLightningStore()
        runners = [Runner(agent, store) for _ in range(self.n_runners)]
        agent.set_trainer(self)
        algorithm.set_trainer(self)
        algorithm.set_store(store)
        algorithm.set_adapter(self.adapter)
        if self.llm_proxy is not None:
            if self.llm_proxy.get_store() is None:
                self.llm_proxy.set_store(store)
            algorithm.set_llm_proxy(self.llm_proxy)
        if self._initial_resources is not None:
            algorithm.set_initial_resources(self._initial_resources)
        stop = asyncio.Event()
        running = [asyncio.create_task(runner.iter(stop_event=stop)) for runner in runners]
        try:
            if algorithm.is_async():
                await algorithm.run(train_dataset, val_dataset)
            else:  # a thread, so that the runners go on in this loop
                outcome = await asyncio.to_thread(algorithm.run, train_dataset, val_dataset)
                if inspect.isawaitable(outcome):
                    await outcome
        finally:
            stop.set()
            failures = [r for r in await asyncio.gather(*running, return_exceptions=True) if isinstance(r, Exception)]
            for runner in runners:
                await runner.close()
            if url is None:
                await store.close()
        if failures:
            raise failures[0]


FLOWS_ENTRY_POINT = "lightning.flows"
"""The entry point group where the flow layer registers how to run a config (`run = "flows.handoff:run_flow"` in
pyproject.toml): the library names neither Prefect nor the flows."""


def _flow_runner() -> Callable[[str, TrainConfig], Awaitable[Any]]:
    found = entry_points(group=FLOWS_ENTRY_POINT, name="run")
    if not found:
        raise RuntimeError(
            f"Trainer: no flow runner is installed (entry point {FLOWS_ENTRY_POINT}:run, from this project's "
            "pyproject.toml); install the project with its flows: pip install -e ."
        )
    return next(iter(found)).load()


def _run_sync(coroutine: Any, method: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError(
        f"Trainer.{method}() was called inside a running event loop; use `await trainer.{method}_async(...)`"
    )


def _base_config(config: TrainConfig | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, TrainConfig):
        return config.model_dump(exclude_unset=True)
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str | Path):
        return load_config(config).model_dump(exclude_unset=True)
    raise TypeError(
        f"Trainer: config= takes a TrainConfig, a dict of its fields or a YAML path, not {type(config).__name__}"
    )


def _algorithm_fields(algorithm: Any) -> dict[str, Any]:
    if isinstance(algorithm, TrainerConfig):
        return algorithm.model_dump(exclude_unset=True)
    if isinstance(algorithm, Mapping):
        if {"actor_rollout_ref", "data", "trainer"} & set(algorithm):
            raise ValueError(
                "Trainer: algorithm= looks like a verl config; wrap it as agent-lightning does: "
                "algorithm=lightning.VERL(config), or give the fields of lightning.TrainerConfig (lr, kl_coef, ...)"
            )
        return dict(algorithm)
    raise TypeError(
        f"Trainer: algorithm= is a {type(algorithm).__name__}; give a lightning.TrainerConfig or a dict of its fields "
        "(lr, kl_coef, advantage, ...), or lightning.VERL(config), lightning.APO(client, ...), a "
        "lightning.Algorithm or an @algo function"
    )


def _tracer(tracer: Any) -> Tracer | None:
    """agl's `tracer=`: OtelTracer() / AgentOpsTracer() (ours) say what each runner records with, which is a tracer
    of ours in every runner, writing to the run's store; agl's other tracers have no counterpart."""
    if tracer is None or isinstance(tracer, Tracer):
        return tracer
    raise TypeError(
        f"Trainer: tracer= is a {type(tracer).__name__}; give lightning.OtelTracer() or AgentOpsTracer() (or leave it "
        "out): each runner of a run records with a tracer of its own into the run's store, and the run's LLM proxy "
        "records every call through the LLM resource"
    )


def _adapter(adapter: Any) -> TraceAdapter[Any]:
    """agl's `adapter=`: an adapter, a dict of TracerTraceToTriplet's options (agl's default class), or None
    (TracerTraceToTriplet())."""
    if adapter is None:
        return TracerTraceToTriplet()
    if isinstance(adapter, Mapping):
        options = dict(adapter)
        kind = str(options.pop("type", "TracerTraceToTriplet")).rpartition(".")[2]
        classes: dict[str, type[TraceAdapter[Any]]] = {
            "TracerTraceToTriplet": TracerTraceToTriplet,
            "LlmProxyTraceToTriplet": LlmProxyTraceToTriplet,
            "TraceToMessages": TraceToMessages,
        }
        if kind not in classes:
            raise TypeError(f"Trainer: adapter={adapter!r}; its type must be one of {sorted(classes)}")
        return classes[kind](**options)
    if isinstance(adapter, TraceAdapter):
        return adapter
    raise TypeError(
        f"Trainer: adapter= is a {type(adapter).__name__}; give lightning.adapter.TracerTraceToTriplet(...) (or a "
        "dict of its options), LlmProxyTraceToTriplet(), TraceToMessages(), or a TraceAdapter of your own for a "
        "custom Algorithm"
    )


def _adapter_fields(adapter: TraceAdapter[Any], *, apo: bool, given: bool) -> dict[str, Any]:
    """What `adapter` means for a run's flow: APO reads transcripts as messages (TraceToMessages, or no adapter);
    `train` and `dev` make training rows with our adapter, which agl's triplet adapters describe
    (`trainer_fields`)."""
    if apo:
        if given and not isinstance(adapter, TraceToMessages):
            raise TypeError(
                f"Trainer: APO reads its rollouts as messages; give adapter=TraceToMessages() or leave it out, not "
                f"{type(adapter).__name__}"
            )
        return {}
    if isinstance(adapter, TraceToTripletBase):
        return adapter.trainer_fields()
    raise TypeError(
        f"Trainer: adapter={type(adapter).__name__}() is not supported here: a run's training rows come from "
        "lightning's adapter (adapter_shape='transition', one row per LLM call, or 'trajectory', one per rollout); "
        "TraceToMessages and adapters of your own are for APO and custom Algorithms, which read them"
    )


def _apo_section(apo: APO[Any], fields: dict[str, Any]) -> dict[str, Any]:
    """APO's `apo` section: its settings, and the seed prompt: the one PromptTemplate of initial_resources (taken
    out of the resources every rollout gets: the flow gives each candidate under the same name)."""
    resources = fields.get("resources", {})
    prompts = [name for name, value in resources.items() if value.get("resource_type") == "prompt_template"]
    if len(prompts) != 1:
        raise ValueError(
            f"Trainer: APO optimises one prompt template, the seed; initial_resources has {len(prompts)} "
            "(give one, e.g. initial_resources={'prompt_template': PromptTemplate(template=..., engine='f-string')})"
        )
    seed = resources.pop(prompts[0])
    section = copy.deepcopy(apo.apo_fields)
    section.update(initial_prompt=seed["template"], prompt_engine=seed["engine"], resource_name=prompts[0])
    return section


def _store_url(store: Any) -> str:
    """The URL the run's parts open `store` by. A store server's token that came with it (in the URL, or the client's
    own) goes to them through this process's environment ($LIGHTNING_STORE_TOKEN), as the flows hand over secrets:
    the config is kept by Prefect and shown in MLflow, so it holds no token (a `${VAR}` reference stays)."""
    if isinstance(store, str):
        url, token = split_credentials(store)
        if not store.startswith(("http://", "https://")) or token is None or REFERENCE.fullmatch(token):
            return store  # a database's password stays in its URL (give it as a `${VAR}` reference)
        os.environ[STORE_TOKEN] = token
        return url
    base_url = getattr(store, "base_url", None)  # an HttpLightningStore: the server the run's parts can reach too
    if isinstance(base_url, str):
        token = getattr(store, "token", None)
        if isinstance(token, str) and token:
            os.environ[STORE_TOKEN] = token
        return base_url
    raise TypeError(
        f"Trainer: store= is a {type(store).__name__}; a run opens its store by URL in every process that needs it: "
        "give the URL (sqlite:///path.db, postgresql://user@host/db, or http://host:port of `lightning store serve`)"
    )


def _resource_fields(resources: Mapping[str, Any]) -> dict[str, Any]:
    """agent-lightning's `initial_resources` as TrainConfig fields. The LLM to train (the only LLM, or the one named
    `main_llm` among several) becomes the run's policy endpoint (inference backend 'external'), given to rollouts
    under its name through the run's proxy; with no LLM, the run serves its own model as `main_llm`. Every other
    resource (prompt templates, LLMs the agent calls as they are) goes to every rollout unchanged."""
    unknown = sorted(name for name, value in resources.items() if not isinstance(value, LLM | PromptTemplate))
    if unknown:
        raise TypeError(f"Trainer: initial_resources {unknown} are not lightning.LLM or lightning.PromptTemplate")
    llms = {name: value for name, value in resources.items() if isinstance(value, LLM)}
    if len(llms) > 1 and "main_llm" not in llms:
        raise ValueError(
            f"Trainer: initial_resources has several LLMs ({sorted(llms)}); name the one the run trains 'main_llm'"
        )
    policy_name = next(iter(llms)) if len(llms) == 1 else "main_llm"
    fields: dict[str, Any] = {
        "resources": {name: value.model_dump() for name, value in resources.items() if name != policy_name}
    }
    policy = llms.get(policy_name)
    if policy is None:
        return fields
    if isinstance(policy, ProxyLLM):
        raise ValueError(
            "Trainer: initial_resources= got a ProxyLLM; the run starts its own proxy: give the LLM behind it"
        )
    if policy.api_key:
        raise ValueError(
            "Trainer: initial_resources= holds an API key; put it in an environment variable and give "
            "inference={'backend': 'external', 'endpoint': ..., 'api_key_env': 'NAME'} instead"
        )
    fields["llm_resource_name"] = policy_name
    fields["inference"] = {"backend": "external", "endpoint": policy.endpoint, "served_model_name": policy.model}
    if policy.sampling_parameters:
        fields["sampling"] = dict(policy.sampling_parameters)
    return fields


def _agent_spec(agent: Any) -> str:
    """`module:name` when the agent's module holds it under a name (and it is not the script run), else a name in
    this process's registry."""
    module_name = getattr(agent, "__module__", None) or type(agent).__module__
    if module_name != "__main__" and module_name in sys.modules:
        module = sys.modules[module_name]
        names = [getattr(agent, "__name__", None)] + [name for name, value in vars(module).items() if value is agent]
        for name in names:
            if isinstance(name, str) and name.isidentifier() and getattr(module, name, None) is agent:
                spec = f"{module_name}:{name}"
                try:
                    if load_entry_point(spec, "agent") is agent:
                        return spec
                except ConfigError:
                    pass
    name = f"{re.sub(r'[^A-Za-z0-9_]', '_', _run_name(agent))}_{next(_ids)}"
    setattr(registry, name, agent)
    return f"{REGISTRY_SPEC}.{name}"


def _run_name(agent: Any) -> str:
    name = agent.__name__ if isinstance(agent, FunctionalLitAgent) else type(agent).__name__
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-._") or "agent"
    return name[:100]


def _dataset_spec(dataset: Any, argument: str, path: Path) -> str:
    if isinstance(dataset, str | Path):
        return str(dataset)
    try:
        tasks = [dataset[i] for i in range(len(dataset))]
    except TypeError as exc:
        raise TypeError(
            f"Trainer: {argument} is a {type(dataset).__name__}; give a list of tasks (or anything with len() and "
            "[i]), a .jsonl/.parquet path or module:function"
        ) from exc
    if not tasks:
        raise ValueError(f"Trainer: {argument} is empty")
    lines = []
    for index, task in enumerate(tasks):
        try:
            lines.append(json.dumps(_plain(task), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"Trainer: {argument}[{index}] cannot be written as JSON ({exc}); tasks are rollout inputs, stored as "
                "JSON: give dicts, lists, strings and numbers (or pydantic models)"
            ) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _plain(task: Any) -> Any:
    dump = getattr(task, "model_dump", None)  # a pydantic model
    return dump(mode="json") if callable(dump) else task


__path__: list[str] = []
"""A package for agent-lightning's paths below `agentlightning.trainer` (lightning.trainer.trainer), which
lightning.agl_import_paths answers for."""


def __getattr__(name: str) -> Any:
    missing(__name__, name)


__all__ = ["Dataset", "Trainer", "registry"]
