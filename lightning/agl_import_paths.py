"""agent-lightning 0.3's public module paths under `lightning`: the module of ours that answers for each, or what
to use instead where there is none.

`import lightning` puts `FINDER` on `sys.meta_path`. A module of ours at agl's path (lightning.store,
lightning.adapter.messages, lightning.config, ...) is imported as usual; one listed in `MODULES` is made on import
from the modules of ours it names (`lightning.litagent` offers `lightning.agent`'s names); one in `NO_MODULE`, or
below one, raises `NotInLightning`, whose message says what to use. A name agl has and we do not raises
`NotInLightning` too (from `NAMES`), from the module where agl has it: `from lightning import APO` fails with the
replacement in the message, not with Python's bare "cannot import name". tests/test_agl_surface.py checks every
module and `__all__` name of the installed agentlightning 0.3.0 against these tables.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import types
from typing import Any, NoReturn


class NotInLightning(ImportError):
    """An agent-lightning module or name with no counterpart here; the message says what to use instead. An
    ImportError, so that `from lightning import X` shows the message (Python replaces an AttributeError's)."""


MODULES: dict[str, tuple[str, ...]] = {
    "adapter.triplet": ("lightning.adapter.agl_triplet", "lightning.adapter"),
    "algorithm.apo": ("lightning.agl_algorithms",),
    "algorithm.apo.apo": ("lightning.agl_algorithms",),
    "algorithm.base": ("lightning.agl_algorithms",),
    "algorithm.decorator": ("lightning.agl_algorithms",),
    "algorithm.fast": ("lightning.agl_algorithms",),
    "algorithm.verl": ("lightning.agl_algorithms",),
    "algorithm.verl.interface": ("lightning.agl_algorithms",),
    "emitter": ("lightning.tracing",),
    "execution": ("lightning.agl_execution",),
    "execution.base": ("lightning.agl_execution",),
    "execution.client_server": ("lightning.agl_execution",),
    "execution.events": ("lightning.agl_execution",),
    "execution.inter_process": ("lightning.agl_execution",),
    "execution.shared_memory": ("lightning.agl_execution",),
    "emitter.annotation": ("lightning.tracing",),
    "emitter.exception": ("lightning.tracing",),
    "emitter.message": ("lightning.tracing",),
    "emitter.object": ("lightning.tracing",),
    "emitter.reward": ("lightning.tracing",),
    "litagent": ("lightning.agent",),
    "llm_proxy": ("lightning.agl_llm_proxy",),
    "litagent.decorator": ("lightning.agent",),
    "litagent.litagent": ("lightning.agent",),
    # Ours is lightning.log_setup: a module named `logging` would hide the standard library's from any script run
    # from inside lightning/.
    "logging": ("lightning.log_setup",),
    "reward": ("lightning.tracing",),
    "runner.agent": ("lightning.runner",),
    "runner.base": ("lightning.runner",),
    "store.client_server": ("lightning.store.client", "lightning.store.agl_server"),
    "store.sqlite": ("lightning.store.sql",),
    "store.threading": ("lightning.store.agl_server",),
    "tracer": ("lightning.tracing",),
    "tracer.agentops": ("lightning.tracing",),
    "tracer.base": ("lightning.tracing",),
    "tracer.otel": ("lightning.tracing",),
    "trainer.trainer": ("lightning.trainer",),
    "types.core": ("lightning.types", "lightning.agent"),
    "types.resources": ("lightning.types",),
    "types.tracer": ("lightning.types", "lightning.tracing", "lightning.semconv"),
}
"""agl module (after `agentlightning.`) -> our modules whose names `lightning.<that path>` offers, first found first.
agl's modules at a path where we have a module of our own are not here: lightning.adapter, lightning.adapter.base,
lightning.adapter.messages,
lightning.algorithm, lightning.cli, lightning.config, lightning.env_var, lightning.runner, lightning.semconv,
lightning.store, lightning.store.base, lightning.store.memory, lightning.trainer, lightning.types."""

_VERL = (
    "agl's verl integration (its trainer, daemon and dataset) is lightning.VERL(config) given to "
    "lightning.Trainer(algorithm=...), which maps the verl config onto the `train` flow (trainer_backend verl)"
)
_CLI = (
    "the command line is `lightning`: `lightning store serve` (agl's `agl store`), `lightning proxy serve`, "
    "`lightning inference serve`; vLLM is `inference.backend: vllm` in a run's config"
)
_LEGACY = (
    "agent-lightning's deprecated 0.1/0.2 API: use lightning.Trainer(...).fit / .dev, lightning.Runner(agent, store) "
    "and the store (lightning.store.client.LightningStoreClient for a store server)"
)
_INSTRUMENT = (
    "nothing to switch on: every call through the rollout's LLM resource is recorded by the run's LLM proxy, token "
    "ids included, and the tracer instruments the OpenAI SDK itself for the agent's other calls "
    "(lightning.tracing.instrument)"
)
_STORE = (
    "the store is lightning.SqlLightningStore (a SQLite file, `sqlite://` in memory, or a PostgreSQL URL); "
    "lightning.store.memory.InMemoryLightningStore is one in memory"
)
_TRACER = (
    "the tracer is lightning.Tracer (agl's OtelTracer and AgentOpsTracer name it), the runner's own (`self.tracer` "
    "in an agent): give it to LitAgentRunner(tracer), or let Runner(agent, store) make one. It records every span, "
    "rewards included, so there is no tracer that records nothing; spans are recorded with the emitters "
    "(emit_reward, emit_annotation, ...) and `with lightning.operation(name) as op:` (op.set_input / set_output), not "
    "with a tracer's operation_context and its recording context"
)
_ACTIVE_TRACER = (
    "a tracer is active inside one of its trace contexts (a runner opens one per attempt), in that thread or asyncio "
    "task only, and lightning.get_active_tracer() returns it; no tracer can be made active outside one, as emitters "
    "record spans of an attempt"
)
_COMPONENTS = (
    "a run's parts are chosen by TrainConfig fields (inference.backend, trainer_backend, task_runner, store_url), "
    "not built from specs"
)
_INTERNAL = "agent-lightning's internal helpers; nothing of them is needed here"
_FILTERS = (
    "queries take their filters as keywords: status_in=, rollout_id_in=, rollout_id_contains=, filter_logic=, "
    "sort_by=, sort_order=, limit=, offset="
)

NO_MODULE: dict[str, str] = {
    "algorithm.utils": _INTERNAL,
    "verl": _VERL,
    "cli.prometheus": _CLI,
    "cli.store": _CLI,
    "cli.vllm": _CLI,
    "client": _LEGACY,
    "server": _LEGACY,
    "runner.legacy": _LEGACY,
    "trainer.legacy": _LEGACY,
    "instrumentation": _INSTRUMENT,
    "store.collection": _STORE,
    "store.collection_based": _STORE,
    "store.mongo": _STORE,
    "store.utils": _INTERNAL,
    "tracer.dummy": _TRACER,
    "tracer.weave": _TRACER,
    "trainer.init_utils": _COMPONENTS,
    "trainer.registry": _COMPONENTS,
    "utils": _INTERNAL,
}
"""agl modules (and the modules below them) with no counterpart here -> what to use instead."""

NAMES: dict[str, str] = {
    "lightning_cli": "a run's settings are a TrainConfig (YAML; `lightning config check FILE`), and the flows take "
    "--set field=value",
    **dict.fromkeys(
        [
            "LegacyAgentRunner",
            "AgentLightningClient",
            "AgentLightningServer",
            "DevTaskLoader",
            "RolloutLegacy",
            "RolloutRawResultLegacy",
            "Task",
            "TaskIfAny",
            "GenericResponse",
            "ParallelWorkerBase",
        ],
        _LEGACY,
    ),
    "CollectionBasedLightningStore": _STORE,
    **dict.fromkeys(["DummyTracer", "SpanRecordingContext"], _TRACER),
    **dict.fromkeys(["set_active_tracer", "clear_active_tracer"], _ACTIVE_TRACER),
    "build_component": _COMPONENTS,
    **dict.fromkeys(["FilterOptions", "SortOptions", "FilterField"], _FILTERS),
}
"""agl names with no counterpart here -> what to use instead (wherever agl has the name)."""


def missing(module_name: str, name: str) -> NoReturn:
    """A module's `__getattr__` for a name it does not have: NotInLightning for an agl name with no counterpart,
    else the usual AttributeError."""
    if name in NAMES:
        raise NotInLightning(f"{module_name} has no {name} (an agent-lightning name): {NAMES[name]}", name=module_name)
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")


def lookup(module_name: str, sources: tuple[str, ...], name: str) -> Any:
    """`name` from the first of the modules `sources` that has it; else as `missing`."""
    if not name.startswith("__"):  # (a module's own dunders are not taken from elsewhere: __path__, __file__, ...)
        for source in sources:
            try:
                return getattr(importlib.import_module(source), name)
            except AttributeError:
                continue
    missing(module_name, name)


def no_module_reason(agl_path: str) -> str | None:
    """Why agl's module `agl_path` (or a package above it) has no counterpart here; None when it has one."""
    parts = agl_path.split(".")
    for end in range(1, len(parts) + 1):
        reason = NO_MODULE.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes the modules of `MODULES` and refuses those of `NO_MODULE`; after the usual finders, so a module of
    ours at the same path always wins."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, agl_path = fullname.partition(".")
        if package != "lightning" or not agl_path:
            return None
        if agl_path in MODULES or no_module_reason(agl_path) is not None:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        agl_path = module.__name__.partition(".")[2]
        reason = no_module_reason(agl_path)
        if reason is not None:
            raise NotInLightning(
                f"lightning has no module {module.__name__} (agentlightning.{agl_path}): {reason}", name=module.__name__
            )
        sources = MODULES[agl_path]
        module.__doc__ = f"agentlightning.{agl_path}'s names, from {', '.join(sources)}."
        module.__path__ = []  # agl's path may go deeper (lightning.tracer.agentops): this finder answers for it
        module.__all__ = sorted({name for source in sources for name in _public_names(source)})  # type: ignore[attr-defined]

        module.__getattr__ = functools.partial(lookup, module.__name__, sources)  # type: ignore[attr-defined]


def _public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:  # what the module defines (a class of pydantic's it imports is not its)
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)
            and getattr(value, "__module__", module_name) == module_name
        ]
    return list(names)


FINDER = _Finder()
