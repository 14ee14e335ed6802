"""The runner: claims rollouts from the store, runs the agent inside a trace context, records the outcome.

A rollout costs the runner two store requests: `claim_rollouts` (the rollout, its attempt already running under
this runner, and its resources unless the runner has them at that version) and `finish_attempt` (the attempt's last
spans, the reward's among them, and its final status, which the store refuses if it moved the attempt on).

While the agent works, a background task beats the attempt's heartbeat, so a long LLM or tool
call is not taken for a dead runner, and checks that the attempt is still this runner's: if the
store's watchdog timed it out or a newer attempt superseded it, the runner abandons the work and
writes nothing over the newer attempt.

An agent that blocks the event loop instead (a blocking call inside `async def`) cannot be watched from it: a
thread watches the loop of a runner task's fleet (`lightning.runner.blocking`) and fails the attempt that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import numbers
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from lightning.agent import Hook, LitAgent, RolloutResult, _current_runner
from lightning.agl_import_paths import missing
from lightning.environment import PROXY_TOKEN
from lightning.runner import blocking
from lightning.store import lifecycle
from lightning.store.base import LightningStore
from lightning.store.errors import AuthError, StoreError
from lightning.types import (
    LLM,
    AttemptedRollout,
    AttemptStatus,
    NamedResources,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
)

logger = logging.getLogger(__name__)

StopEvent = threading.Event | asyncio.Event
T = TypeVar("T")


class Runner(Generic[T]):
    """Runs `agent` on rollouts from `store`. One runner works on one rollout at a time; run many
    (threads, processes or machines) for parallelism.

    - `worker_id`: how the store knows this runner (default: host-pid-object).
    - `heartbeat_interval`: seconds between attempt heartbeats while the agent works; keep it well
      under the rollouts' `unresponsive_seconds`.
    - `idle_wait`: longest single wait for work when the queue is empty; an enqueue through the same
      store (or the same store server) wakes the runner at once.
    - `queue`: the store queue it takes rollouts from (None: the default queue).
    """

    def __init__(
        self,
        agent: LitAgent[Any],
        store: LightningStore,
        *,
        tracer: Any | None = None,
        worker_id: str | None = None,
        hooks: Sequence[Hook] = (),
        heartbeat_interval: float = 5.0,
        idle_wait: float = 1.0,
        queue: str | None = None,
    ) -> None:
        from lightning.tracing import Tracer

        self.agent = agent
        self.store = store
        self.tracer = tracer if tracer is not None else Tracer(store)
        self._owns_tracer = tracer is None
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.hooks = list(hooks)
        self.heartbeat_interval = heartbeat_interval
        self.idle_wait = idle_wait
        self.queue = queue
        self.resources: dict[str, ResourcesUpdate] = {}
        """The resources its claims brought, by id: a claim sends their versions and brings only what changed."""
        self._failure: BaseException | None = None  # what the agent raised in the latest attempt
        if isinstance(agent, LitAgent):
            agent.set_runner(self)  # agent-lightning's `self.runner` / `self.tracer` inside the agent

    async def iter(self, *, stop_event: StopEvent | None = None, max_rollouts: int | None = None) -> int:
        """Claim and run rollouts until `stop_event` is set or `max_rollouts` ran; returns how many ran. A fleet of one
        (`run_fleet`), which beats this runner's worker heartbeat while it waits for work."""
        return await run_fleet(
            [self], self.store, stop_event=stop_event, queue=self.queue, idle_wait=self.idle_wait,
            max_rollouts=max_rollouts, known=self.resources, idle_heartbeat=self.heartbeat_interval,
        )  # fmt: skip

    async def step(
        self,
        input: Any,
        *,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        resources: NamedResources | None = None,
        config: RolloutConfig | None = None,
    ) -> Rollout:
        """Run one ad-hoc rollout of `input` now, outside the queue; returns the finished rollout. Its resources:
        those stored under `resources_id`, or `resources` (stored first, as agent-lightning's `step` does), else the
        latest."""
        if resources is not None:
            if resources_id is not None:
                raise ValueError("step: give resources or resources_id, not both")
            resources_id = (await self.store.add_resources(resources)).resources_id
        started = await self.store.start_rollout(
            input, mode=mode, resources_id=resources_id, config=config, worker_id=self.worker_id, queue=self.queue
        )
        await self.run_attempt(started)
        finished = await self.store.get_rollout_by_id(started.rollout_id)
        assert finished is not None
        return finished

    async def run_attempt(self, claimed: AttemptedRollout, *, resources: ResourcesUpdate | None = None) -> str:
        """Run the agent on a claimed attempt and record its outcome. Returns the attempt's final
        status as reported ("succeeded" / "failed"), or "abandoned" when the store moved the
        attempt on before the agent finished. `resources`: the rollout's resources when the caller has them (a
        claim brought them); otherwise they are read from the store."""
        rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
        self._failure = None
        for hook in self.hooks:
            await hook.on_rollout_start(agent=self.agent, runner=self, rollout=claimed)
        if claimed.attempt.status != "running" or claimed.attempt.worker_id != self.worker_id:
            # A dequeued (preparing) attempt; a claim_rollouts one is running under this runner already.
            await self.store.update_attempt(rollout_id, attempt_id, status="running", worker_id=self.worker_id)

        trace = self._trace_context(rollout_id, attempt_id)
        work = asyncio.create_task(self._traced_rollout(claimed, trace, resources))
        watch = asyncio.create_task(self._heartbeat_until_moved_on(rollout_id, attempt_id))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the runner itself is cancelled (a run that stops): so is the agent
            work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
            raise
        if work not in done:
            # The store moved the attempt on: stop the agent (a sync agent's thread runs out on its own).
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            logger.warning("rollout %s attempt %s was moved on by the store; abandoned", rollout_id, attempt_id)
            status = "abandoned"
            if getattr(trace, "handed_over", None):  # the trace so far still belongs in the store
                with contextlib.suppress(StoreError):
                    await self.store.add_many_spans(trace.handed_over, number=True)
        else:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            # Cancelled: by the loop's watchdog, which failed the attempt in the store (the agent blocked the loop).
            failure = work.cancelled() or work.exception() is not None
            self._failure = None if work.cancelled() else work.exception()
            status = await self._record_outcome(
                rollout_id, attempt_id, "failed" if failure else "succeeded", getattr(trace, "handed_over", [])
            )
        for hook in self.hooks:
            await hook.on_rollout_end(agent=self.agent, runner=self, rollout=claimed, status=status)
        return status

    def _trace_context(self, rollout_id: str, attempt_id: str) -> Any:
        """Our tracer's context hands the spans still queued at its exit (the reward's, typically) over to
        `finish_attempt`, one request for both; another tracer's writes them itself."""
        from lightning.tracing import Tracer

        if isinstance(self.tracer, Tracer):
            return self.tracer.trace_context(rollout_id, attempt_id, hand_over=True)
        return self.tracer.trace_context(rollout_id, attempt_id)

    async def _traced_rollout(self, claimed: AttemptedRollout, trace: Any, given: ResourcesUpdate | None) -> None:
        """The agent inside the trace context; its return value becomes a reward span or spans.
        Raises what the agent raised, after recording it as an exception span."""
        from lightning.tracing import emit_exception, emit_reward

        _current_runner.set(self)  # this task's (and a sync agent's thread's) `agent.runner`
        resources, proxies = await self._resources(claimed, given)
        if hasattr(trace, "proxied"):
            trace.proxied = proxies
        # `async with`: the exit waits for the attempt's spans being written without blocking the event loop the
        # other runners of a fleet share (a plain `with` would hold the loop for a store write per rollout).
        async with trace:
            for hook in self.hooks:
                await hook.on_trace_start(agent=self.agent, runner=self, tracer=self.tracer, rollout=claimed)
            try:
                with blocking.holding(claimed):  # an agent that blocks the loop is blamed on this attempt
                    result = await self.agent.run(claimed.input, resources, claimed)
                await self._store_result(claimed, result, emit_reward)
            except Exception as exc:
                logger.info("rollout %s failed: %r", claimed.rollout_id, exc)
                emit_exception(exc)
                raise
            finally:
                for hook in self.hooks:
                    await hook.on_trace_end(agent=self.agent, runner=self, tracer=self.tracer, rollout=claimed)

    async def _resources(
        self, claimed: AttemptedRollout, given: ResourcesUpdate | None
    ) -> tuple[NamedResources, frozenset[str]]:
        """The rollout's resources, and the host:port of the LLM proxies among them."""
        if claimed.resources_id is None:
            return {}, frozenset()
        if given is not None and given.resources_id == claimed.resources_id:
            found: ResourcesUpdate | None = given
        else:
            found = await self.store.get_resources_by_id(claimed.resources_id)
        if found is None:
            raise LookupError(f"rollout {claimed.rollout_id} names resources {claimed.resources_id!r}, which are gone")
        # An LLM behind the proxy reaches the agent already routed to this attempt, so its calls
        # are stored as this attempt's spans whatever kind of agent makes them.
        resources = {
            name: _routed(resource, claimed) if isinstance(resource, ProxyLLM) else resource
            for name, resource in found.resources.items()
        }
        proxies = frozenset(
            urlsplit(resource.endpoint).netloc
            for resource in found.resources.values()
            if isinstance(resource, ProxyLLM)
        )
        return resources, proxies

    async def _store_result(self, claimed: AttemptedRollout, result: RolloutResult, emit_reward: Any) -> None:
        """The agent's return value stored: a reward span, or its spans. A value that is not one names the agent's
        own line in its error, since the traceback holds only the runner's frames (the agent had returned)."""
        if result is None:
            return
        if isinstance(result, numbers.Real):  # a bool too (1.0 / 0.0, as in agent-lightning), numpy's np.float32 too
            try:
                emit_reward(float(result))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (returned by {agent_location(self.agent)})") from None
            return
        if isinstance(result, list):
            await self._store_spans(claimed, result)
            return
        raise TypeError(
            f"the agent returned {type(result).__name__} {str(result)[:40]!r} ({agent_location(self.agent)}); "
            "return a float or bool reward, spans or None"
        )

    async def _store_spans(self, claimed: AttemptedRollout, spans: list[Any]) -> None:
        from lightning.tracing import SpanCoreFields

        rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
        converted = []
        for span in spans:
            fields = {"rollout_id": rollout_id, "attempt_id": attempt_id, "sequence_id": 0}  # the store numbers them
            if isinstance(span, Span):
                converted.append(span.model_copy(update=fields))
            elif isinstance(span, SpanCoreFields):  # what an emitter returned (propagate=False)
                ids_ = {"trace_id": secrets.token_hex(16), "span_id": secrets.token_hex(8)}
                converted.append(Span(**fields, **ids_, **span.model_dump()))
            else:  # an OpenTelemetry ReadableSpan
                converted.append(Span.from_opentelemetry(span, rollout_id, attempt_id, 0))
        await self.store.add_many_spans(converted, number=True)

    async def _heartbeat_until_moved_on(self, rollout_id: str, attempt_id: str) -> None:
        """Beat the attempt's heartbeat; return when the attempt is no longer this runner's to finish."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self.store.update_attempt(rollout_id, attempt_id, last_heartbeat_time=time.time())
            await self.store.update_worker(self.worker_id)
            if not await self._still_ours(rollout_id, attempt_id):
                return

    async def _still_ours(self, rollout_id: str, attempt_id: str) -> bool:
        """The attempt is still active and its rollout's latest, and the rollout was not cancelled."""
        (rollout,) = await self.store.query_rollouts(rollout_id_in=[rollout_id]) or [None]
        return (
            isinstance(rollout, AttemptedRollout)
            and rollout.status != "cancelled"
            and rollout.attempt.attempt_id == attempt_id
            and rollout.attempt.status in lifecycle.ACTIVE_ATTEMPT
        )

    async def _record_outcome(self, rollout_id: str, attempt_id: str, status: AttemptStatus, spans: list[Span]) -> str:
        """The last spans and the final status in one request; the store keeps its own verdict on an attempt it
        timed out, marked unresponsive or superseded meanwhile."""
        attempt = await self.store.finish_attempt(rollout_id, attempt_id, status, spans)
        if attempt.status != status:
            logger.warning(
                "rollout %s attempt %s ended as %s elsewhere; not overwritten with %s",
                rollout_id, attempt_id, attempt.status, status,
            )  # fmt: skip
            return "abandoned"
        return status

    async def close(self) -> None:
        if self._owns_tracer:
            self.tracer.shutdown()


def known_versions(known: dict[str, ResourcesUpdate]) -> dict[str, int]:
    """The `known_resources` of a claim: id -> the version held, so the store sends only what changed."""
    return {resources_id: update.version for resources_id, update in known.items()}


async def run_fleet(
    runners: Sequence[Runner],
    store: LightningStore,
    *,
    stop_event: StopEvent | None,
    queue: str | None = None,
    idle_wait: float = 0.05,
    max_rollouts: int | None = None,
    known: dict[str, ResourcesUpdate] | None = None,
    idle_heartbeat: float | None = None,
) -> int:
    """The claim loop, the one place runners take work (`Runner.iter` is a fleet of one): run rollouts of `queue` on
    `runners`, all on this event loop, until `stop_event` is set or `max_rollouts` ran; how many ran.

    One loop claims work for the whole fleet: a rollout for each idle runner, in one `claim_rollouts` naming
    their worker ids (each attempt starts running under its runner's id), each handed to that runner's
    `run_attempt` with its resources, which the claim brings only when the fleet lacks them (`known`: what the fleet
    holds, by resources id). (Each runner polling on its own costs a store transaction per idle runner each time
    anything in the store changes.) An empty queue is waited on for up to `idle_wait` seconds at a time (an enqueue
    through the same store wakes the wait at once), so the fleet stops within about `idle_wait` of `stop_event`;
    running rollouts finish first. `idle_heartbeat`: seconds between worker heartbeats of the idle runners (None:
    none). A store that fails is tried again with back-off; one that refuses the token raises AuthError."""
    if len({runner.worker_id for runner in runners}) != len(runners):
        raise ValueError("run_fleet: the runners' worker_ids repeat; give each runner its own worker_id")
    idle = list(runners)
    known = {} if known is None else known
    freed = asyncio.Event()  # a runner became idle
    working: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []  # what a runner raised besides a store error (a refused token, a bug)
    ran = 0
    backoff = 0.1
    last_beat = 0.0

    async def work(runner: Runner, claimed: AttemptedRollout) -> None:
        nonlocal ran
        try:
            await runner.run_attempt(claimed, resources=known.get(claimed.resources_id or ""))
            ran += 1
        except AuthError as exc:
            errors.append(exc)
        except StoreError as exc:
            # The store failed mid-attempt: its watchdog requeues what the runner held.
            logger.warning("runner %s: store error %s; the attempt is left to the watchdog", runner.worker_id, exc)
        except Exception as exc:
            errors.append(exc)
        finally:
            idle.append(runner)
            freed.set()

    try:
        while not (stop_event is not None and stop_event.is_set()) and not errors:
            wanted = len(idle)
            if max_rollouts is not None:
                if ran >= max_rollouts:
                    break
                wanted = min(wanted, max_rollouts - ran - (len(runners) - len(idle)))  # less those running
            if wanted <= 0:
                freed.clear()
                await freed.wait()
                continue
            try:
                claim = await store.claim_rollouts(
                    [runner.worker_id for runner in idle[:wanted]],
                    wait=idle_wait,
                    queue=queue,
                    known_resources=known_versions(known),
                )
                if not claim.rollouts and idle_heartbeat is not None and time.monotonic() - last_beat > idle_heartbeat:
                    for runner in idle:
                        await store.update_worker(runner.worker_id)
                    last_beat = time.monotonic()
            except AuthError:
                raise  # a refused token stays refused: trying again forever would only hide it
            except StoreError as exc:
                # The store is unreachable or refused: the watchdog requeues what the runners held; keep trying.
                logger.warning("runner fleet: store error %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.1
            known.update((update.resources_id, update) for update in claim.resources)
            by_worker = {runner.worker_id: runner for runner in idle}
            for rollout in claim.rollouts:
                runner = by_worker[rollout.attempt.worker_id or ""]
                idle.remove(runner)
                task = asyncio.create_task(work(runner, rollout))
                working.add(task)
                task.add_done_callback(working.discard)
    except asyncio.CancelledError:
        # Cancelled (a run that stops): the rollouts in flight are cancelled too, not waited for.
        for task in working:
            task.cancel()
        raise
    finally:
        await asyncio.gather(*working, return_exceptions=True)
    if errors:
        raise errors[0]
    return ran


class LitAgentRunner(Runner[T]):
    """agent-lightning's form of the runner, for driving one agent by hand: made from a tracer
    (`LitAgentRunner(OtelTracer())`), handed its agent and store by `run_context(agent=, store=)`, then `step(task,
    resources={...})` or `iter()` inside it. Everything else is Runner's; `Runner(agent, store)` is the short form.

    `max_rollouts` bounds `iter`; `poll_interval` is the longest wait for work (an enqueue wakes it sooner). agl's
    heartbeat tuning (`interval_jitter`, `heartbeat_launch_mode`, `heartbeat_include_gpu`) is accepted and changes
    nothing: the attempt's heartbeat runs beside the agent on the event loop, and a thread watches for a blocked loop.
    """

    _AGL_HEARTBEAT_OPTIONS = frozenset({"interval_jitter", "heartbeat_launch_mode", "heartbeat_include_gpu"})

    def __init__(
        self,
        tracer: Any | None = None,
        max_rollouts: int | None = None,
        poll_interval: float = 5.0,
        heartbeat_interval: float = 10.0,
        **heartbeat_options: Any,
    ) -> None:
        unknown = sorted(set(heartbeat_options) - self._AGL_HEARTBEAT_OPTIONS)
        if unknown:
            raise TypeError(f"LitAgentRunner() got unexpected keyword arguments {unknown}")
        self._given_tracer = tracer
        self.max_rollouts = max_rollouts
        self._settings = {"heartbeat_interval": heartbeat_interval, "idle_wait": poll_interval}
        self._in_context = False

    @contextlib.contextmanager
    def run_context(
        self,
        *,
        agent: LitAgent[T],
        store: LightningStore,
        hooks: Sequence[Hook] | None = None,
        worker_id: int | None = None,
    ) -> Iterator[LitAgentRunner[T]]:
        """This runner running `agent` on `store` inside the block; the tracer it was made with writes to `store`.
        `worker_id` is agl's worker number, which names nothing here (the runner has its own worker id)."""
        if self._given_tracer is not None and hasattr(self._given_tracer, "init_worker"):
            self._given_tracer.init_worker(worker_id or 0, store)
        Runner.__init__(self, agent, store, tracer=self._given_tracer, hooks=hooks or (), **self._settings)  # type: ignore[arg-type]
        self._in_context = True
        try:
            yield self
        finally:
            self._in_context = False
            if self._owns_tracer:
                self.tracer.shutdown()

    async def step(self, input: Any, *, event: Any = None, **options: Any) -> Rollout:
        """Runner.step, as agl's: what the agent raised is raised here too, after the failed attempt is recorded.
        (`event`, agl's stop signal, is unused there as here.)"""
        self._require_context("step")
        finished = await super().step(input, **options)
        if finished.status == "failed" and self._failure is not None:
            raise self._failure
        return finished

    async def iter(  # type: ignore[override]
        self, *, event: StopEvent | None = None, stop_event: StopEvent | None = None, max_rollouts: int | None = None
    ) -> int:
        """Runner.iter until `event` (agl's name for `stop_event`) is set or `max_rollouts` (else the runner's) ran."""
        self._require_context("iter")
        return await super().iter(stop_event=event or stop_event, max_rollouts=max_rollouts or self.max_rollouts)

    def _require_context(self, what: str) -> None:
        if not self._in_context:
            raise RuntimeError(f"LitAgentRunner.{what}() runs inside `with runner.run_context(agent=..., store=...):`")


def __getattr__(name: str) -> Any:
    missing(__name__, name)


__all__ = ["LitAgentRunner", "Runner", "run_fleet"]


def agent_location(agent: LitAgent[Any]) -> str:
    """`first_letter at examples/first_agent/agent.py:31`: the agent's rollout function and where it is defined
    (relative to the working directory where it can be), for errors about what it returned."""
    function = getattr(agent, "func", None)  # a @rollout function
    if function is None:
        kind = type(agent)
        function = kind.rollout_async if kind.rollout_async is not LitAgent.rollout_async else kind.rollout
    try:
        path, line = inspect.getsourcefile(function) or "?", inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        return getattr(function, "__qualname__", repr(agent))
    with contextlib.suppress(ValueError):
        path = str(Path(path).resolve().relative_to(Path.cwd()))
    return f"{function.__qualname__} at {path}:{line}"


UNUSED_KEY = "unused"
"""The key agents get when this process has no proxy token in its environment (OpenAI's SDK refuses to start without
one): a proxy without a token, or one on loopback that serves any key (`TrainConfig.proxy_any_agent_key`), takes it;
a run's proxy otherwise refuses it, naming the fix."""


def _routed(llm: ProxyLLM, claimed: AttemptedRollout) -> LLM:
    """The run's LLM for this attempt: its route in the endpoint, and the proxy's key from this process's environment
    ($LIGHTNING_PROXY_TOKEN: the run's proxy needs it on every call), never from the store."""
    token = llm.api_key or os.environ.get(PROXY_TOKEN)
    routed = llm.for_attempt(claimed, token)  # signed with the token
    routed.api_key = token or UNUSED_KEY
    return routed
