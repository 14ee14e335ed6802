"""Processes a run starts die with the process that started them, even when it is killed with SIGKILL.

The parent marks each child's environment with its own pid (`child_env`); the child (`exit_with_parent`, called
at start-up by every program of ours a run starts) watches its parent pid on a daemon thread and ends itself, and
the process group it leads, once the parent is gone. Programs that are not ours (vLLM, Prefect's temporary
server) run under `python -m lightning.lifeline -- COMMAND...`, which does the same for them.

Why polling the parent pid rather than prctl(PR_SET_PDEATHSIG) or a pipe: the parent-death signal fires when
the *thread* that started the child exits, and a run starts its children from worker threads (Prefect's task
threads, asyncio.to_thread) that end long before the run; a watchdog pipe needs its descriptor carried through
multiprocessing's spawn and through third-party launchers. A reparented process sees a new parent pid whatever
thread started it, within the poll interval.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from lightning.environment import EXIT_WITH_PARENT

PARENT_ENV = EXIT_WITH_PARENT
"""Set by the parent to its pid in a child's environment: the child exits when that process is gone."""
POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child that must die with this process: `base` (default: this process's), `extra`,
    and this process's pid as the parent to watch."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env[PARENT_ENV] = str(os.getpid())
    return env


def exit_with_parent(parent_pid: int | None = None) -> bool:
    """In a child: end this process when its parent (the pid its environment names, or `parent_pid`) is gone.
    Returns whether it watches: not when started by anyone else (a user's shell), so the programs stay usable on
    their own."""
    named = os.environ.pop(PARENT_ENV, None)
    if parent_pid is None:
        if named is None or not named.isdigit() or int(named) != os.getppid():
            return False  # not started by a run, or by a process that passed the variable on (a grandchild)
        parent_pid = int(named)

    def watch() -> None:
        while True:
            time.sleep(POLL_SECONDS)
            if os.getppid() != parent_pid:
                _end_own_group()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    return True


def _end_own_group() -> None:
    """Kill what this process leads (its process group, when it leads one), then itself."""
    with contextlib.suppress(OSError):
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """`python -m lightning.lifeline -- COMMAND...`: run COMMAND in this process's group and end the group when
    this process's parent is gone. SIGTERM and SIGINT reach COMMAND; the exit code is COMMAND's."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m lightning.lifeline -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    os.environ.pop(PARENT_ENV, None)
    try:
        child = subprocess.Popen(args)
    except OSError as exc:
        print(f"lightning.lifeline: cannot run {args[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: child.send_signal(number))
    while True:
        try:
            code = child.wait(POLL_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            if code < 0:  # killed by a signal: end the same way, so our parent sees what happened to COMMAND
                with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set (nor needs to)
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        if os.getppid() != parent:
            child.terminate()
            try:
                child.wait(GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
            _end_own_group()


if __name__ == "__main__":
    raise SystemExit(main())
