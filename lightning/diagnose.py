"""Why is a run stuck: every process of a run (the flow's, the inference server, the proxy, the trainer) writes its
Python stacks, all threads, to `<run_dir>/stacks/<component>-<pid>.txt` when it receives SIGUSR1 (`faulthandler`,
so even a process stuck in C code or holding the GIL answers). `lightning debug stacks RUN` signals them all and
prints what they wrote; the run's supervisor does the same, and logs it, when no stage has finished for
`timeouts.stall_warning` seconds.

Why do its rollouts fail: `agent_errors` reads the first failed rollouts' exceptions from the store (the runner
records what the agent raised as a span), for the error of a rollout phase that failed and the `dev` flow's summary.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from lightning import semconv
from lightning.environment import STACKS_DIR as STACKS_ENV

SIGNAL = signal.SIGUSR1
_FILE = re.compile(r"^(?P<component>[\w.-]+)-(?P<pid>\d+)\.txt$")
_open: list[IO[str]] = []  # faulthandler writes to these until the process ends


def dump_stacks_on_signal(directory: str | Path | None, component: str) -> Path | None:
    """In this process: on SIGUSR1, append every thread's stack to `<directory>/<component>-<pid>.txt`. With no
    directory given, $LIGHTNING_STACKS_DIR (set by the run for its children), else nothing."""
    directory = directory or os.environ.get(STACKS_ENV)
    if not directory:
        return None
    path = Path(directory) / f"{component}-{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life: faulthandler writes to it)
    _open.append(stream)
    faulthandler.register(SIGNAL, file=stream, all_threads=True)
    return path


def collect_stacks(directory: str | Path, wait: float = 1.5) -> str:
    """Signal every live process that registered under `directory`, wait for their dumps, and return them (one
    section a process); a process that is gone is said to be gone."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"no stacks directory {directory}: the run has not started there (or this is not a run directory)"
    sizes: dict[Path, int] = {}
    sections = []
    for path in sorted(directory.glob("*.txt")):
        match = _FILE.match(path.name)
        if match is None:
            continue
        pid = int(match["pid"])
        before = path.stat().st_size  # before the signal: an idle process dumps at once
        try:
            os.kill(pid, SIGNAL)
        except ProcessLookupError:
            continue  # an earlier process of the run
        except PermissionError:
            sections.append(f"== {match['component']} (pid {pid}): not ours to signal")
            continue
        sizes[path] = before
    time.sleep(wait)
    for path, before in sizes.items():
        match = _FILE.match(path.name)
        assert match is not None
        with contextlib.suppress(OSError):
            with open(path, errors="replace") as stream:
                stream.seek(before)
                dump = stream.read().strip() or "(no answer within the wait: stuck in a system call?)"
            sections.append(f"== {match['component']} (pid {match['pid']})\n{dump}")
    return "\n\n".join(sections) if sections else f"no live process of the run has registered in {directory}"


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


async def agent_errors(store: Any, rollout_ids: Sequence[str], limit: int = 3) -> list[str]:
    """What the agent raised in the first `limit` failed rollouts of `rollout_ids` (their latest attempts), one
    line each: `<rollout id>: TypeError: <message> (at <file>:<line> in <function>)`, the frame being the innermost
    of the agent's own code. Rollouts that failed without an error recorded (a timeout) are left out."""
    failed = await store.query_rollouts(rollout_id_in=list(rollout_ids), status_in=["failed"])
    ids = [rollout.rollout_id for rollout in failed][: limit * 4]
    errors = []
    for rollout_id, spans in (await store.query_latest_spans(ids)).items() if ids else []:
        for span in spans:
            event = next((e for e in span.events if e.name == "exception"), None)
            if span.name != semconv.EXCEPTION_SPAN or event is None:
                continue
            attributes = event.attributes
            message = " ".join(str(attributes.get("exception.message", "")).split())[:300]
            frame = _agent_frame(str(attributes.get("exception.stacktrace", "")))
            errors.append(f"{rollout_id}: {attributes.get('exception.type', 'Exception')}: {message}{frame}")
            break
        if len(errors) == limit:
            break
    return errors


def _agent_frame(stacktrace: str) -> str:
    """` (at FILE:LINE in FUNCTION)` for the innermost frame of the agent's own code: not an installed package's,
    nor this library's (the runner calling the agent); nothing if every frame is (an error about what the agent
    returned names the agent's line in its message: the library's line would only mislead)."""
    library = str(Path(__file__).resolve().parent)
    frames = list(_FRAME.finditer(stacktrace))
    chosen = [f for f in frames if "-packages" not in f["path"] and not f["path"].startswith(library)][-1:]
    if not chosen:
        return ""
    path = chosen[0]["path"]
    with contextlib.suppress(ValueError):
        path = str(Path(path).relative_to(Path.cwd()))
    return f" (at {path}:{chosen[0]['line']} in {chosen[0]['function']})"
