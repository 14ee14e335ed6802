"""A graceful stop of the run in this process: the first SIGINT or SIGTERM asks for it (`request_stop`, called by
the command that handles the signal: `flows.cli`), the stages see it and end early with `RunStopped` (nothing
half-written: a rollout phase cancels its unfinished rollouts, a PPO step not yet started is not started), and the
run closes in order. The library never installs a signal handler itself: a notebook or a script decides."""

from __future__ import annotations

import threading
import time

_requested = threading.Event()
_state = {"reason": "", "since": 0.0}
POLL_SECONDS = 0.5
"""How often a wait (rollouts, a server starting) looks whether a stop was asked for."""


class RunStopped(Exception):
    """The run was asked to stop (SIGINT, SIGTERM) and ended its current stage early; it resumes where it was."""


def request_stop(reason: str) -> None:
    """Ask the run in this process to stop at the next stage boundary (or now, in a wait)."""
    if not _requested.is_set():
        _state["reason"], _state["since"] = reason, time.monotonic()
        _requested.set()


def stop_requested() -> bool:
    return _requested.is_set()


def reason() -> str:
    return str(_state["reason"])


def seconds_since_request() -> float:
    """Seconds since the stop was asked for (0 when it was not)."""
    return time.monotonic() - float(_state["since"]) if _requested.is_set() else 0.0


def clear() -> None:
    """Forget a stop asked for earlier (a process that opens another run after a stopped one)."""
    _requested.clear()
    _state["reason"], _state["since"] = "", 0.0


def check(where: str) -> None:
    """Raise RunStopped if a stop was asked for; `where` is the stage that stops."""
    if _requested.is_set():
        raise RunStopped(f"{where} not started: the run was asked to stop ({reason()})")
