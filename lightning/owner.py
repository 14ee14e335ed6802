"""One run, one owner: the process that trains a run holds `<run_dir>/owner.lock` (its pid, host and command), so a
second training of the same run_name (a `train` in another shell, a second deployment run) is refused while the
first lives, with one line naming the owner. A lock whose process is gone (killed, the machine rebooted) is taken
over, with a log line. Taken once per process: by `python -m flows.train` before Prefect is imported
(`flows.arguments.take_the_run`), or by `Run.open` (deployments, `Trainer.fit`, scripts); this process taking it again
(`flows.cli`, then `Run.open`) finds it held without looking at the file."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "owner.lock"

_held: set[Path] = set()
"""The lock files this process holds."""


class RunLocked(RuntimeError):
    """Another live process trains this run."""


class RunLock:
    """The lock file of a run directory, held by this process until `release`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def release(self) -> None:
        """Remove the lock file if it is still this process's."""
        _held.discard(self.path.absolute())
        owner = _read(self.path)
        if owner is not None and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)


def acquire(run_dir: Path, run_name: str) -> RunLock | None:
    """Take the run's lock; None when this process holds it already (its holder releases it). Raises RunLocked when
    another live process holds it."""
    path = run_dir / LOCK_NAME
    if path.absolute() in _held:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": shlex.join(sys.orig_argv),
    }
    for _ in range(20):
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "w") as lock:
                json.dump(me, lock)
            _held.add(path.absolute())
            return RunLock(path)
        owner = _read(path)
        if owner is None:  # being written by its owner this instant, or left empty by a crash
            if time.time() - _mtime(path) < 2.0:
                time.sleep(0.1)
                continue
            owner = {}
        pid, host = owner.get("pid"), owner.get("host")
        if pid == me["pid"] and host == me["host"]:
            return None
        if host == me["host"] and isinstance(pid, int) and _alive(pid):
            raise RunLocked(_held_message(run_name, owner))
        if host not in (None, me["host"]):
            raise RunLocked(
                f"run {run_name!r} is held by pid {pid} on {host} ({path}), which this machine cannot check; if that "
                f"process is gone, delete {path}, or give this run another run_name (--set run_name=...)"
            )
        logger.warning("run %s: taking over the lock %s of pid %s on %s, which is gone", run_name, path, pid, host)
        stale = path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.replace(path, stale)  # one taker wins the rename; the others find the new lock next time round
        except FileNotFoundError:
            continue
        stale.unlink(missing_ok=True)
    raise RunLocked(f"run {run_name!r}: could not take its lock {path}; delete it if no process trains this run")


def _held_message(run_name: str, owner: dict) -> str:
    pid = owner.get("pid")
    return (
        f"run {run_name!r} is being trained by pid {pid} on {owner.get('host')} (since "
        f"{time.strftime('%H:%M:%S', time.localtime(owner.get('started', 0)))}: {owner.get('command', '?')}); "
        f"wait for it, stop it (Ctrl-C or kill -TERM {pid}), or give this run another run_name (--set run_name=...)"
    )


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a zombie (exited, not yet reaped) no longer trains
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return True
