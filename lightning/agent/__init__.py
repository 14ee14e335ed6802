"""The agent API: `LitAgent` to subclass, or `@rollout` on a plain function; and runner hooks.

An agent gets a task (the rollout's input), the rollout's resources and the attempted rollout,
and returns None (its reward was emitted as a span), a float or bool (the reward), or a list of spans.
As in agent-lightning, an agent knows the runner running it (`self.runner`, `self.tracer`) and the
Trainer that trains it (`self.trainer`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lightning.types import LLM, AttemptedRollout, NamedResources, PromptTemplate, ProxyLLM, Span

if TYPE_CHECKING:
    from lightning.runner import Runner
    from lightning.tracing import Tracer
    from lightning.trainer import Trainer

logger = logging.getLogger(__name__)

T = TypeVar("T")
RolloutResult = None | float | int | bool | list[Span] | list[Any]
RolloutRawResult = RolloutResult  # agent-lightning's name
"""What a rollout returns: None, a reward (a bool counts as 1.0 / 0.0), or spans (ours, OpenTelemetry
ReadableSpans, or what the emitters return)."""

# The runner running the current rollout (in this asyncio task, or the thread a sync agent runs in): many runners
# may share one agent object, and each rollout's `self.runner` is the one running it.
_current_runner: contextvars.ContextVar[Runner | None] = contextvars.ContextVar("lightning_runner", default=None)


class LitAgent(Generic[T]):
    """Subclass and override `rollout` (sync) or `rollout_async` (async). Override
    `training_rollout` / `validation_rollout` (or their async forms) to act differently when the
    rollout's mode is "train" or "val"/"test"; by default both call `rollout`.

    `trained_agents` (agent-lightning's argument) is kept as `self.trained_agents` and changes nothing: every
    call the agent makes through the rollout's LLM resource is trained, calls to other endpoints are not.
    A subclass may define no `__init__`, or one that calls `super().__init__(...)`."""

    trained_agents: str | None = None
    _trainer_ref: weakref.ReferenceType[Trainer] | None = None
    _runner_ref: weakref.ReferenceType[Runner] | None = None

    def __init__(self, *, trained_agents: str | None = None) -> None:
        self.trained_agents = trained_agents
        self._trainer_ref = None
        self._runner_ref = None

    def __getstate__(self) -> dict[str, Any]:
        # Sent to another process (pickled), an agent leaves its trainer and runner behind: they are this process's.
        state = dict(self.__dict__)
        state.pop("_trainer_ref", None)
        state.pop("_runner_ref", None)
        return state

    # --- the trainer, runner and tracer using the agent (agent-lightning's attributes) ---

    def set_trainer(self, trainer: Trainer) -> None:
        """Called by `Trainer.fit` / `Trainer.dev` with itself."""
        self._trainer_ref = weakref.ref(trainer)

    def _referent(self, ref: weakref.ref[Any] | None, missing: str) -> Any:
        found = ref() if ref is not None else None
        if found is None:
            raise ValueError(f"{type(self).__name__}.{missing}")
        return found

    def get_trainer(self) -> Trainer:
        return self._referent(
            self._trainer_ref,
            "trainer: no Trainer is training this agent; it is set by lightning.Trainer(...).fit(agent, ...) or "
            ".dev(agent, ...)",
        )

    @property
    def trainer(self) -> Trainer:
        """The `lightning.Trainer` whose fit/dev runs this agent."""
        return self.get_trainer()

    def set_runner(self, runner: Runner) -> None:
        """Called by a runner when it starts using the agent."""
        self._runner_ref = weakref.ref(runner)

    def get_runner(self) -> Runner:
        current = _current_runner.get()
        if current is not None and current.agent is self:
            return current
        return self._referent(
            self._runner_ref,
            "runner: no runner is using this agent; it is set when a lightning.runner.Runner starts using it (inside "
            "a rollout it is the runner running it)",
        )

    @property
    def runner(self) -> Runner:
        """The runner running this rollout (outside a rollout: the last runner that started using the agent)."""
        return self.get_runner()

    def get_tracer(self) -> Tracer:
        try:
            return self.get_runner().tracer
        except ValueError:
            raise ValueError(
                f"{type(self).__name__}.tracer is the tracer of the runner running the agent, and no runner is "
                "using it yet; read it inside a rollout"
            ) from None

    @property
    def tracer(self) -> Tracer:
        """The tracer of the runner running the agent: its spans go to the rollout's attempt."""
        return self.get_tracer()

    # --- rollouts ---

    def rollout(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        raise TypeError(f"{type(self).__name__} must override rollout() or rollout_async()")

    async def rollout_async(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        raise TypeError(f"{type(self).__name__} must override rollout() or rollout_async()")

    def training_rollout(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    async def training_rollout_async(
        self, task: T, resources: NamedResources, rollout: AttemptedRollout
    ) -> RolloutResult:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(
        self, task: T, resources: NamedResources, rollout: AttemptedRollout
    ) -> RolloutResult:
        return await self.rollout_async(task, resources, rollout)

    @property
    def is_async(self) -> bool:
        """True if the agent overrides any async rollout method (the runner then awaits it)."""
        cls = type(self)
        return any(
            getattr(cls, name) is not getattr(LitAgent, name)
            for name in ("rollout_async", "training_rollout_async", "validation_rollout_async")
        )

    async def run(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        """Run the rollout method that fits the rollout's mode; a sync agent runs in a worker thread
        so that the runner's heartbeats go on while it works."""
        validating = rollout.mode in ("val", "test")
        is_async = self.is_async
        if callable(is_async):  # an agent-lightning agent may override is_async() as a method
            is_async = is_async()
        if is_async:
            method = self.validation_rollout_async if validating else self.training_rollout_async
            return await method(task, resources, rollout)
        method_sync = self.validation_rollout if validating else self.training_rollout
        return await asyncio.to_thread(method_sync, task, resources, rollout)


# Parameters a @rollout function may declare, besides the task, and what each receives.
_INJECTED = ("llm", "prompt_template", "rollout", "resources")


class FunctionalLitAgent(LitAgent[T]):
    """A LitAgent around a plain function, made by `@rollout`; calling it calls the function."""

    def __init__(self, func: Callable[..., Any]) -> None:
        super().__init__()
        self.func = func
        self._async = inspect.iscoroutinefunction(func)
        self._wants = _check_signature(func)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    @property
    def is_async(self) -> bool:
        return self._async

    def rollout(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        return self.func(task, **self._arguments(resources, rollout))

    async def rollout_async(self, task: T, resources: NamedResources, rollout: AttemptedRollout) -> RolloutResult:
        return await self.func(task, **self._arguments(resources, rollout))

    def _arguments(self, resources: NamedResources, rollout: AttemptedRollout) -> dict[str, Any]:
        given: dict[str, Any] = {}
        if "llm" in self._wants:
            given["llm"] = _first_llm(resources, rollout)
        if "prompt_template" in self._wants:
            given["prompt_template"] = _first_of(resources, PromptTemplate, "prompt_template")
        if "rollout" in self._wants:
            given["rollout"] = rollout
        if "resources" in self._wants:
            given["resources"] = resources
        return given


def rollout(func: Callable[..., Any]) -> FunctionalLitAgent[Any]:
    """Make an agent of a function `[async] def f(task, llm | prompt_template [, rollout] [, resources])`.

    `llm` receives the first LLM resource (a ProxyLLM already routed to this rollout and attempt),
    `prompt_template` the first PromptTemplate, `rollout` the AttemptedRollout, `resources` all of them.
    """
    return FunctionalLitAgent(func)


def llm_rollout(func: Callable[..., Any] | None = None, *, strip_proxy: bool = True) -> Any:
    """agent-lightning's `@llm_rollout` / `@llm_rollout(strip_proxy=...)`: `@rollout` for `f(task, llm[, rollout])`.
    The LLM always reaches the agent routed to its rollout's attempt, which is what strip_proxy=True gives."""

    def decorate(function: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        agent = FunctionalLitAgent(function)
        if "llm" not in agent._wants:
            raise TypeError(f"@llm_rollout function {function.__name__}() must take an `llm` parameter")
        return agent

    return decorate(func) if func is not None else decorate


def prompt_rollout(func: Callable[..., Any] | None = None) -> Any:
    """agent-lightning's `@prompt_rollout`: `@rollout` for `f(task, prompt_template[, rollout])`."""

    def decorate(function: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        agent = FunctionalLitAgent(function)
        if "prompt_template" not in agent._wants:
            raise TypeError(f"@prompt_rollout function {function.__name__}() must take a `prompt_template` parameter")
        return agent

    return decorate(func) if func is not None else decorate


def _check_signature(func: Callable[..., Any]) -> set[str]:
    params = list(inspect.signature(func).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(f"@rollout function {func.__name__}() must take the task as its first parameter")
    wants = set()
    for param in params[1:]:
        if param.name in _INJECTED:
            wants.add(param.name)
        elif param.default is inspect.Parameter.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(
                f"@rollout function {func.__name__}() has parameter {param.name!r} that the runner cannot fill; "
                f"besides the task it may take {', '.join(_INJECTED)}"
            )
    return wants


def _first_llm(resources: NamedResources, rollout: AttemptedRollout) -> LLM:
    llm = _first_of(resources, LLM, "llm")
    return llm.with_attempted_rollout(rollout) if isinstance(llm, ProxyLLM) else llm


def _first_of(resources: NamedResources, kind: type, parameter: str) -> Any:
    found = [name for name, resource in resources.items() if isinstance(resource, kind)]
    if not found:
        raise ValueError(
            f"the agent asks for {parameter!r} but the rollout's resources have no {kind.__name__} "
            f"(resources: {sorted(resources) or 'none'}); add one with store.add_resources()"
        )
    if len(found) > 1:
        logger.warning("several %s resources %s; %r gets %r", kind.__name__, found, parameter, found[0])
    return resources[found[0]]


class Hook:
    """Callbacks around each rollout a runner executes; override the ones you need (all async)."""

    async def on_rollout_start(self, *, agent: LitAgent[Any], runner: Runner, rollout: AttemptedRollout) -> None:
        """Before the agent runs (resources fetched, trace not yet open)."""

    async def on_trace_start(
        self, *, agent: LitAgent[Any], runner: Runner, tracer: Any, rollout: AttemptedRollout
    ) -> None:
        """Inside the trace context, before the agent runs: spans emitted here belong to the attempt. `tracer`: the
        runner's."""

    async def on_trace_end(
        self, *, agent: LitAgent[Any], runner: Runner, tracer: Any, rollout: AttemptedRollout
    ) -> None:
        """Inside the trace context, after the agent returned or raised (`tracer.get_last_trace()`: its spans so
        far)."""

    async def on_rollout_end(
        self, *, agent: LitAgent[Any], runner: Runner, rollout: AttemptedRollout, status: str
    ) -> None:
        """After the attempt's outcome was recorded (`status` is what the runner reported, or
        "abandoned" when the store had moved the attempt on)."""


__all__ = ["FunctionalLitAgent", "Hook", "LitAgent", "RolloutResult", "llm_rollout", "prompt_rollout", "rollout"]
