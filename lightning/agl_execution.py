"""agent-lightning's execution strategies and events (its `agentlightning.execution`), by their names.

agl's strategy lays out a Trainer's algorithm and runners: `SharedMemoryExecutionStrategy` (threads of one process)
or `ClientServerExecutionStrategy` (runner processes that reach the algorithm's store over HTTP). Here a run lays out
its own runners, and the strategy picks how: `Trainer(strategy=...)` takes one of these (or agl's "shm" / "cs", or a
dict with "type") and sets `task_runner` and `n_runners`:

    SharedMemoryExecutionStrategy(n_runners=4)    task_runner 'default': runner tasks on threads of the flow's process
    ClientServerExecutionStrategy(n_runners=4)    task_runner 'processes': each runner task's runners in a process of
                                                  the run's own, reaching the run's store directly

The knobs of agl's orchestration (timeouts, which side runs on the main thread, the server's address) have no
counterpart and are accepted unused; `role` other than "both" is refused as `AGL_CURRENT_ROLE` is (see `Trainer`).

The events are what a runner's `iter(event=...)` stops on: any object with `is_set()`.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Mapping
from multiprocessing.context import BaseContext
from typing import Any, Literal, Protocol


class ExecutionEvent(Protocol):
    """agl's stop signal: set, clear, is_set, wait."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class _HeldEvent:
    """An ExecutionEvent that passes each call to the event it holds (`_event`, set by the subclass)."""

    _event: Any

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class ThreadingEvent(_HeldEvent):
    """An ExecutionEvent for threads (and asyncio tasks) of one process: a `threading.Event`."""

    def __init__(self) -> None:
        self._event = threading.Event()


class MultiprocessingEvent(_HeldEvent):
    """An ExecutionEvent shared with child processes: a `multiprocessing.Event` (of `ctx`, else the default)."""

    def __init__(self, *, ctx: BaseContext | None = None) -> None:
        self._event = (ctx or multiprocessing).Event()  # type: ignore[attr-defined]


class ExecutionStrategy:
    """agl's base class: here a strategy only says how a run lays out its runners (`trainer_fields`)."""

    task_runner: Literal["default", "processes"] = "default"

    def __init__(self, n_runners: int | None = None) -> None:
        self.n_runners = n_runners

    def trainer_fields(self) -> dict[str, Any]:
        """The TrainConfig fields this strategy means: `task_runner`, and `n_runners` when it gives one."""
        fields: dict[str, Any] = {"task_runner": self.task_runner}
        if self.n_runners is not None:
            fields["n_runners"] = self.n_runners
        return fields

    def execute(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.execute: a run lays out its algorithm and runners itself; give the strategy to "
            "lightning.Trainer(strategy=...), which runs them"
        )


class SharedMemoryExecutionStrategy(ExecutionStrategy):
    """The runners on threads of one process, the algorithm beside them: TrainConfig.task_runner 'default'."""

    task_runner = "default"

    def __init__(
        self,
        n_runners: int = 1,
        main_thread: Literal["algorithm", "runner"] = "runner",
        join_timeout: float = 15.0,
        graceful_delay: float = 5.0,
        poll_interval: float = 0.05,
        managed_store: bool | None = None,
    ) -> None:
        if main_thread not in ("algorithm", "runner"):
            raise ValueError("SharedMemoryExecutionStrategy: main_thread must be 'algorithm' or 'runner'")
        super().__init__(n_runners)
        self.main_thread = main_thread


class ClientServerExecutionStrategy(ExecutionStrategy):
    """The runners in processes of their own: TrainConfig.task_runner 'processes' (they reach the run's store
    directly, so no server address is needed)."""

    task_runner = "processes"

    def __init__(
        self,
        role: Literal["algorithm", "runner", "both"] | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        n_runners: int = 1,
        graceful_timeout: float = 10.0,
        terminate_timeout: float = 10.0,
        main_process: Literal["algorithm", "runner"] = "algorithm",
        managed_store: bool | None = None,
        allowed_exit_codes: Any = (0, -15),
    ) -> None:
        if role not in (None, "both"):
            raise ValueError(
                f"ClientServerExecutionStrategy(role={role!r}): a run starts its runners beside its algorithm; to run "
                "runners on other machines give task_runner='ray', or run lightning.Runner(agent, "
                "LightningStoreClient(url)).iter() there against `lightning store serve`"
            )
        super().__init__(n_runners)


STRATEGY_ALIASES: dict[str, type[ExecutionStrategy]] = {
    "shm": SharedMemoryExecutionStrategy,
    "shared_memory": SharedMemoryExecutionStrategy,
    "cs": ClientServerExecutionStrategy,
    "client_server": ClientServerExecutionStrategy,
}
"""agl's names for its strategies in `Trainer(strategy="shm")` and `{"type": "cs", ...}`."""


def as_strategy(spec: Any, n_runners: int | None = None) -> ExecutionStrategy:
    """A strategy from what agl's Trainer takes: a strategy, a name ("shm", "cs") or a dict with "type" and the
    strategy's keywords; a name or a dict without `n_runners` takes the Trainer's `n_runners`, as agl's does."""
    if isinstance(spec, ExecutionStrategy):
        return spec
    defaults = {"n_runners": n_runners} if n_runners is not None else {}
    if isinstance(spec, str) and spec in STRATEGY_ALIASES:
        return STRATEGY_ALIASES[spec](**defaults)
    if isinstance(spec, Mapping) and spec.get("type") in STRATEGY_ALIASES:
        options = {**defaults, **{key: value for key, value in spec.items() if key != "type"}}
        return STRATEGY_ALIASES[spec["type"]](**options)
    raise TypeError(
        f"Trainer: strategy={spec!r}; give 'shm' or 'cs' (or a dict with that 'type'), or "
        "lightning.SharedMemoryExecutionStrategy(...) / ClientServerExecutionStrategy(...): they set task_runner "
        "('default': threads of the flow; 'processes': processes of the run) and n_runners"
    )


__all__ = [
    "ClientServerExecutionStrategy",
    "ExecutionEvent",
    "ExecutionStrategy",
    "MultiprocessingEvent",
    "SharedMemoryExecutionStrategy",
    "ThreadingEvent",
    "as_strategy",
]
