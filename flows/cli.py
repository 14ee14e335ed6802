"""`python -m flows.<name> CONFIG.yaml [--set field=value ...]`: run a flow on a config file from the shell."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flows.arguments import flow_arguments
from flows.secret_blocks import URL_FIELDS, export_secret_blocks
from lightning import owner, preflight, stopping
from lightning.config import load_config
from lightning.config_file import parse_overrides
from lightning.credentials import redact, references
from lightning.environment import PREFECT_UI
from lightning.errors import ConfigError
from lightning.metrics import LOCAL_PREFECT_UI, LOCAL_UI, is_server, ui_command
from lightning.serving import free_port
from lightning.stack import ServerProcess
from lightning.store import open_store


@contextlib.contextmanager
def temporary_prefect_server(log_path: Path, start_timeout: float) -> Iterator[None]:
    """Without a Prefect server configured (PREFECT_API_URL), one for this command, as Prefect would start (the same
    app, UI off), but under `lightning.lifeline`: it dies with this process even when this process is killed, which
    Prefect's own temporary server does not (it is stopped at exit, which SIGKILL skips). It may take
    `start_timeout` seconds to answer (the run's `timeouts.startup`: 15 to 20 s on 2 cores, more under load)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    import prefect

    port = free_port()
    uvicorn = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent)]
    uvicorn += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
    uvicorn += ["--log-level", "error", "--lifespan", "on"]
    env = {
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    command = [sys.executable, "-m", "lightning.lifeline", "--", *uvicorn]
    server = ServerProcess(
        "temporary Prefect server", command, env, f"http://127.0.0.1:{port}/api", log_path, start_timeout,
        lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    print(
        f"Starting a temporary Prefect server on {server.url} (log: {log_path}). It has no UI: `make prefect-ui` "
        f"shows this command's flow runs at {LOCAL_PREFECT_UI}/runs, during the run or after it.",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    server.start()
    try:
        # No UI URL for Prefect itself, which would print "View at <UI URL>" where nothing listens; the links we make
        # (MLflow's run tags and description) point where `make prefect-ui` shows the same database.
        with (
            temporary_settings({PREFECT_API_URL: server.url, PREFECT_UI_URL: ""}),
            _environment(PREFECT_UI, LOCAL_PREFECT_UI),
        ):
            yield
    finally:
        # What this process still has queued for the server (the last log lines, events) goes before it stops: a
        # stopped server kept Prefect's log worker retrying for a minute at exit ("Error logging to API").
        _send_queued_logs_and_events()
        server.stop()


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _send_queued_logs_and_events(timeout: float = 15.0) -> None:
    """Prefect's log and event workers send what they hold, and this waits for them. `drain_all` blocks only where
    no event loop runs in the calling thread (in one it returns an awaitable), so it runs on a thread of its own:
    the same from the CLI and from `lightning.Trainer` inside its event loop."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    def drain() -> None:
        APILogWorker.drain_all(timeout=timeout)
        EventsWorker.drain_all(timeout=timeout)

    thread = threading.Thread(target=drain, name="prefect-drain")
    thread.start()
    thread.join()


def _names_secret_blocks(config: Any) -> bool:
    return any(kind == "secret" for field in URL_FIELDS for kind, _ in references(getattr(config, field)))


def run_flow_cli(flow: Any, argv: list[str] | None, description: str | None) -> Any:
    args = flow_arguments(flow.name, description).parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, "-m", f"flows.{flow.name}", *argv])
    lock = None
    try:
        config = load_config(args.config, **parse_overrides(args.set))
        # One run, one owner, checked before anything starts: a twin is refused in the seconds of an import.
        lock = owner.acquire(config.run_dir, config.run_name) if flow.name == "train" else None
        if _names_secret_blocks(config):
            asyncio.run(export_secret_blocks(config))  # from the Prefect server that holds them
        # Seconds, before anything starts; `evaluate` runs the held-out tasks alone.
        preflight.check(config, optimiser=flow.name == "optimize_prompt", training=flow.name != "evaluate")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _release(lock)
        raise SystemExit(2) from None
    except owner.RunLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    stop = GracefulStop(config.timeouts.stop, command)
    prefect_log = config.run_dir / "logs" / "prefect-server.log"
    try:
        with (
            stop.handling_signals(),
            temporary_prefect_server(prefect_log, config.timeouts.startup),
            progress_bar(flow.name, config),
        ):
            result = stop.run(lambda: asyncio.run(flow(config)))
    except stopping.RunStopped as exc:
        print(f"\nstopped ({stopping.reason()}): {exc}. Resume with: {command}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
    except Exception as exc:
        if stopping.stop_requested():  # what the stop cut short may fail otherwise; it stopped all the same
            print(f"\nstopped ({stopping.reason()}) with {_one_line(exc)}. Resume with: {command}", file=sys.stderr)
            raise SystemExit(stop.exit_code) from None
        print(f"\nerror: {_one_line(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        _release(lock)
        # The run is closed: what is left of this process only ends. Its heap (a million objects after a run) goes
        # out of the collector's reach, which at exit would pass over it several times (2.5 s of one core on an idle
        # machine, much more on a loaded one), past the point where the stop deadline's thread can still end it.
        gc.freeze()
    print(json.dumps(result, indent=2, default=str))
    if isinstance(result, dict) and "reward_after" in result:
        print(where_to_look(config, result))
    return result


def _release(lock: owner.RunLock | None) -> None:
    if lock is not None:
        lock.release()


def _one_line(exc: BaseException) -> str:
    """The error as the one line a command ends with: its type and the first line of its message (the flow's log
    above holds the rest, with the traceback)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class GracefulStop:
    """Ctrl-C and SIGTERM for a command that runs a flow. The flow runs on a thread of its own (`run`), and the main
    thread only waits for it and handles the signals: Prefect's engine swaps in a SIGTERM handler of its own (it
    raises in the flow) only on the main thread, and a KeyboardInterrupt raised in the middle of a flow left it
    half done. The first signal asks the run to stop (`lightning.stopping`) and prints what happens next; past
    `grace` seconds (timeouts.stop), or on a second signal, the process ends at once (its servers die with it)."""

    def __init__(self, grace: float, command: str) -> None:
        self.grace = grace
        self.command = command
        self.signal: int | None = None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signal or signal.SIGINT)

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        previous = {number: signal.signal(number, self._on_signal) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _on_signal(self, number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if self.signal is not None:
            print(f"\n{name} again: ending now. Resume with: {self.command}", file=sys.stderr, flush=True)
            os._exit(128 + number)
        self.signal = number
        stopping.request_stop(name)
        print(
            f"\n{name}: stopping the run: the stage in flight ends, what is done is kept, then its servers stop "
            f"(at most {self.grace:g} s, timeouts.stop); {name} again ends it at once",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        threading.Thread(target=self._deadline, name="stop-deadline", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace)
        print(
            f"\nthe run did not stop within {self.grace:g} s (timeouts.stop): ending now; its latest checkpoint "
            f"is kept. Resume with: {self.command}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        os._exit(self.exit_code)

    def run(self, function: Callable[[], Any]) -> Any:
        """`function()` on a thread of its own, in this thread's context (the temporary Prefect server's settings
        live in a context variable); its result, or what it raised."""
        outcome: dict[str, Any] = {}
        context = contextvars.copy_context()

        def target() -> None:
            try:
                outcome["result"] = context.run(function)
            except BaseException as exc:  # handed to the main thread, which raises it
                outcome["error"] = exc

        thread = threading.Thread(target=target, name="flow", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]


@contextlib.contextmanager
def progress_bar(flow_name: str, config: Any, interval: float = 1.0) -> Iterator[None]:
    """On a terminal, a bar of the training iterations done, with the rollouts of the run's queue finished and in
    flight, drawn from the run's checkpoints and store every `interval` seconds while the flow runs; log lines print
    above it. Nothing when stderr is not a terminal (CI, a file, a pipe) or the flow is not `train`."""
    if flow_name != "train" or not sys.stderr.isatty():
        yield
        return

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    stop = threading.Event()
    bar = tqdm(total=config.iterations, desc=config.run_name, unit="it", file=sys.stderr, dynamic_ncols=True)

    def watch() -> None:
        asyncio.run(_watch(config, bar, stop, interval))

    watcher = threading.Thread(target=watch, name="progress-bar", daemon=True)
    watcher.start()
    try:
        # Prefect's console handler is the root logger's: its lines go through tqdm, above the bar.
        with logging_redirect_tqdm(loggers=[logging.getLogger()], tqdm_class=tqdm):
            yield
    finally:
        stop.set()
        watcher.join(timeout=5)
        bar.close()


async def _watch(config: Any, bar: Any, stop: Any, interval: float) -> None:
    from lightning.progress import snapshot

    store = None
    try:
        while not stop.wait(interval):
            if store is None:
                if not config.run_dir.exists():  # the run has not opened its store yet
                    continue
                store = open_store(config.store_url, watchdog_interval=None)
            try:
                now = await snapshot(config, store)
            except Exception:  # a store busy or not there yet: the next look will do
                continue
            if now.iterations_done > bar.n:
                bar.update(now.iterations_done - bar.n)
            bar.set_postfix_str(f"rollouts {now.rollouts_finished}/{now.rollouts_enqueued} done", refresh=True)
    finally:
        if store is not None:
            await store.close()


def where_to_look(config: Any, summary: dict[str, Any]) -> str:
    """The end of a training run on the command line: the reward before and after, and where the details are."""
    before, after = summary["reward_before"], summary["reward_after"]
    warm = f"{summary['reward_initial']:.3f} initially, " if config.warm_start is not None else ""
    start = "after the warm start" if config.warm_start is not None else "before training"
    return (
        f"\nHeld-out reward of {summary['run_name']}: {warm}{before:.3f} {start}, {after:.3f} after "
        f"{summary['iterations']} iterations of RL.\n"
        f"  checkpoint:  {summary['checkpoint']}\n"
        f"  Prefect UI:  make prefect-ui   then open {LOCAL_PREFECT_UI}/runs "
        f"(flow run {config.run_name!r})\n"
        f"  MLflow UI:   {mlflow_ui(config.tracking_uri)}   (run {config.run_name!r} of experiment "
        f"{config.experiment!r}: metrics, agent traces, config.yaml)\n"
        + (
            f"  model:       models:/{model['name']}/{model['version']} registered; promote it with "
            f".venv/bin/lightning mlflow promote {model['name']} {model['version']}\n"
            if (model := summary.get("registered_model"))
            else ""
        )
    )


def mlflow_ui(tracking_uri: str) -> str:
    """How to see the runs of `tracking_uri`: a server's address, or the command that serves a local store's UI."""
    if is_server(tracking_uri):
        return f"open {redact(tracking_uri)}"
    return f"{ui_command(tracking_uri)}   then open {LOCAL_UI}"
