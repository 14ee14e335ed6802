"""The torch trainer in a child process of its own: a core and GIL apart from runners and servers, and a hard deadline
on every call (a blocking step in a thread cannot be stopped; a process can be killed).

Parent and child speak JSON over a pipe. A call that passes its deadline kills the child. A killed or crashed child
loses the steps since the last checkpoint; the next call starts a fresh one, which resumes from the latest checkpoint
under `checkpoint_root` bit-exactly (weights, optimizer, scheduler and RNG states).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning import pipes, stopping
from lightning.devices import resolve_device
from lightning.diagnose import dump_stacks_on_signal
from lightning.lifeline import exit_with_parent

if TYPE_CHECKING:
    from lightning.algorithm.trainer import TorchTrainer, TrainerConfig


class TrainerTimeout(TimeoutError):
    """A trainer call passed its deadline; the child was killed."""


class TrainerCrashed(RuntimeError):
    """The trainer process died; the steps since the latest checkpoint are lost."""


class TrainerError(RuntimeError):
    """The trainer raised inside the child; the child is still running and usable."""


class UpdateLost(RuntimeError):
    """A checkpoint was asked of a trainer process that did not take the update it would hold."""


class TrainerWorker:
    """TorchTrainer in a child process, started lazily and restarted from the latest checkpoint after a timeout or
    crash. Batches travel as files (TrainingBatch.save), so only small JSON messages cross the pipe."""

    def __init__(
        self,
        model_dir: str | Path,
        config: TrainerConfig,
        checkpoint_root: str | Path,
        *,
        threads: int | None = None,
        start_timeout: float = 300.0,
        stacks_dir: str | Path | None = None,
        deterministic: bool = False,
    ) -> None:
        """`deterministic`: torch's deterministic algorithms in the child (the same batch gives the same update on a
        GPU too; on a CPU it already does)."""
        self.model_dir = str(model_dir)
        self.deterministic = deterministic
        self.config = config
        self.checkpoint_root = str(checkpoint_root)
        self.threads = threads
        self.start_timeout = start_timeout
        self.stacks_dir = None if stacks_dir is None else str(stacks_dir)
        self.resumed_from: int | None = None
        """The checkpoint step the current child resumed from; None when it started from model_dir."""
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the child unless it is running, and wait until its trainer is loaded."""
        if self.alive:
            return
        self._stop(kill=True)
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        config = self.config.model_dump(mode="json")
        args = (
            child_conn, self.model_dir, config, self.checkpoint_root, self.threads, os.getpid(), self.stacks_dir,
            self.deterministic,
        )  # fmt: skip
        self._process = context.Process(target=_serve, args=args, name="trainer-worker", daemon=True)
        self._process.start()
        child_conn.close()  # the child holds its own copy; closing ours makes the child's death an EOF here
        self._conn = parent_conn
        ready = self._receive("start", self.start_timeout)
        self.resumed_from = ready["resumed_from"]

    def step(self, batch_path: str | Path, *, timeout: float) -> dict[str, float]:
        """One PPO/GRPO update on the batch file; its metrics."""
        return self._call({"op": "step", "batch_path": str(batch_path)}, timeout)

    def sft_step(
        self, batch_path: str | Path, *, timeout: float, lr: float | None = None, rows: list[int] | None = None
    ) -> dict[str, float]:
        """One supervised update on the batch file (its `rows` only, when given) at `lr` (None: the schedule's);
        its metrics."""
        return self._call({"op": "sft_step", "batch_path": str(batch_path), "lr": lr, "rows": rows}, timeout)

    def start_rl(self, *, timeout: float = 60) -> None:
        """After a warm start: a fresh optimizer and LR schedule (RL starts from step 0) and the KL reference
        taken from the policy now (`TorchTrainer.start_rl`)."""
        self._call({"op": "start_rl"}, timeout)

    def save_checkpoint(
        self, step: int, *, meta: dict[str, Any] | None = None, keep_last: int | None = 3, timeout: float = 600
    ) -> str:
        """Checkpoint weights and trainer state under checkpoint_root; the step directory."""
        request = {"op": "save_checkpoint", "step": step, "meta": meta, "keep_last": keep_last}
        return self._call(request, timeout)

    def close(self) -> None:
        """Ask the child to exit, kill it if it does not; safe to call twice."""
        self._stop(kill=False)

    def __enter__(self) -> TrainerWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, Any], timeout: float) -> Any:
        if self._process is not None and not self._process.is_alive():
            # Died between calls: say so once (its unsaved steps are gone); the next call restarts it.
            raise TrainerCrashed(f"trainer process died before {request['op']} (exit code {self._stop(kill=True)})")
        self.start()
        assert self._conn is not None
        with contextlib.suppress(OSError):  # a broken pipe: the receive below reports the death and exit code
            pipes.send(self._conn, request)
        return self._receive(request["op"], timeout)

    def _receive(self, op: str, timeout: float) -> Any:
        assert self._conn is not None
        try:
            answered = self._poll(self._conn, op, timeout)
        except BaseException:
            # Interrupted (Ctrl-C, cancellation): the reply still in flight would answer the next call instead.
            self._stop(kill=True)
            raise
        if not answered:
            self._stop(kill=True)
            raise TrainerTimeout(
                f"trainer {op} did not answer within {timeout:g}s; killed it, and the next call restarts it from "
                "the latest checkpoint"
            )
        try:
            reply = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise TrainerCrashed(f"trainer process died during {op} (exit code {self._stop(kill=True)})") from None
        if "error" in reply:
            if op == "start":
                self._stop(kill=True)
            if reply["error"].startswith(f"{UpdateLost.__name__}:"):
                raise UpdateLost(reply["error"].split(": ", 1)[1])
            raise TrainerError(f"trainer {op} failed: {reply['error']}\n{reply['traceback']}")
        return reply if op == "start" else reply["result"]

    @staticmethod
    def _poll(conn: Connection, op: str, timeout: float) -> bool:
        """Wait for the child's reply; a start is given up when the run is asked to stop (an update in flight
        finishes: it is checkpointed)."""
        if op != "start":
            return conn.poll(timeout)
        deadline = time.monotonic() + timeout
        while not conn.poll(max(min(deadline - time.monotonic(), stopping.POLL_SECONDS), 0.0)):
            if stopping.stop_requested():
                raise stopping.RunStopped("the trainer was starting when the run was asked to stop")
            if time.monotonic() >= deadline:
                return False
        return True

    def _stop(self, *, kill: bool) -> int | None:
        """End the child (politely unless `kill`) and forget it; its exit code."""
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        return pipes.end(process, conn, kill=kill)


# --- the child --------------------------------------------------------------------------------


def _serve(
    conn: Connection,
    model_dir: str,
    config: dict[str, Any],
    checkpoint_root: str,
    threads: int | None,
    parent: int,
    stacks_dir: str | None,
    deterministic: bool = False,
) -> None:
    """The child's loop: load the trainer, say ready, then answer one request at a time until told to close. It
    dies with its parent: a trainer never goes on (and writes a checkpoint) for a run that is gone."""
    # A process group of its own: Ctrl-C in a terminal reaches the run, which stops the trainer itself, after
    # any update in flight.
    os.setpgid(0, 0)
    exit_with_parent(parent)
    dump_stacks_on_signal(stacks_dir, "trainer")
    if deterministic:
        import torch

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        trainer, resumed_from = _load_trainer(model_dir, config, checkpoint_root, threads)
    except Exception as exc:
        pipes.send(conn, pipes.error_reply(exc))
        return
    pipes.send(conn, {"ready": True, "resumed_from": resumed_from})
    session = _Session(trainer, checkpoint_root, saved_step=resumed_from)
    for request in pipes.requests(conn):
        try:
            pipes.send(conn, {"result": session.handle(request)})
        except Exception as exc:
            pipes.send(conn, pipes.error_reply(exc))
    # Skip the interpreter's teardown, over a second with torch and transformers loaded: checkpoints are fsynced
    # when saved, so stdio is all there is to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load_trainer(
    model_dir: str, config: dict[str, Any], checkpoint_root: str, threads: int | None
) -> tuple[TorchTrainer, int | None]:
    """A trainer from the latest checkpoint if there is one (its KL reference still the original model; with LoRA,
    model_dir with the checkpoint's adapter), else from model_dir; and the step it resumed from."""
    import torch

    from lightning.algorithm.trainer import TorchTrainer, TrainerConfig
    from lightning.checkpoint import latest_checkpoint, load_checkpoint, resume_trainer

    trainer_config = TrainerConfig.model_validate(config)
    on_gpu = resolve_device(trainer_config.device, "algorithm.device").type == "cuda"
    torch.set_num_threads(threads or default_threads(os.cpu_count() or 1, on_gpu))
    latest = latest_checkpoint(checkpoint_root)
    if latest is None:
        return TorchTrainer(model_dir, trainer_config), None
    checkpoint = load_checkpoint(latest)
    if (checkpoint.base_model is not None) != (trainer_config.lora is not None):
        held = "a LoRA adapter" if checkpoint.base_model is not None else "whole weights"
        raise ValueError(
            f"checkpoint {checkpoint.path} holds {held} and algorithm.lora is "
            f"{'set' if trainer_config.lora else 'not'}: a run keeps the choice it started with"
        )
    if trainer_config.lora is not None:  # the base stays the initial model; the adapter continues
        trainer = TorchTrainer(model_dir, trainer_config, adapter=checkpoint.model_dir)
    else:
        reference = model_dir if trainer_config.uses_reference else None
        trainer = TorchTrainer(checkpoint.model_dir, trainer_config, reference=reference)
    resume_trainer(trainer, checkpoint)
    return trainer, checkpoint.step


def default_threads(cpu_count: int, cuda: bool) -> int:
    """The trainer's torch threads when the config sets none: half the cores on a CPU, torch's own count on a GPU.
    On a CPU the trainer shares the cores with the inference server and the runners, and OpenMP threads that lose
    their core to another process stall every operator at a barrier: measured on 2 cores (trainer_bench), a tiny
    model's update took a steady 45 ms with 1 thread and 30 ms to 2 s with torch's default of 2."""
    if cuda:
        import torch

        return torch.get_num_threads()
    return max(1, cpu_count // 2)


class _Session:
    """What the child has done since it started: the step whose weights it holds as saved, and whether an update
    since then waits to be saved. A checkpoint is written only for an update this process took: when the process
    that took it died, saving "step k+1" again would pass the weights of checkpoint k off as the next step."""

    def __init__(self, trainer: TorchTrainer, checkpoint_root: str, saved_step: int | None) -> None:
        self.trainer = trainer
        self.checkpoint_root = checkpoint_root
        self.saved_step = saved_step
        self.pending = False

    def handle(self, request: dict[str, Any]) -> Any:
        from lightning.algorithm.batch import TrainingBatch

        op = request["op"]
        if op == "step":
            metrics = self.trainer.step(TrainingBatch.load(request["batch_path"]))
            self.pending = True
            return metrics
        if op == "sft_step":
            batch = TrainingBatch.load(request["batch_path"])
            if request.get("rows") is not None:
                batch = batch.select(request["rows"])
            metrics = self.trainer.sft_step(batch, request.get("lr"))
            self.pending = True
            return metrics
        if op == "start_rl":
            self.trainer.start_rl()
            return None
        if op == "save_checkpoint":
            return self.save(request["step"], request["meta"], request["keep_last"])
        if op == "sleep":  # for tests only: a call guaranteed to pass a short deadline
            time.sleep(request["seconds"])
            return None
        raise ValueError(f"unknown request {op!r}")

    def save(self, step: int, meta: dict[str, Any] | None, keep_last: int | None) -> str:
        from lightning.checkpoint import checkpoint_dir, save_checkpoint

        if not self.pending:
            if self.saved_step == step:  # saved already (a retried checkpoint stage): the same checkpoint
                return str(checkpoint_dir(self.checkpoint_root, step))
            held = "the initial model" if self.saved_step is None else f"checkpoint {self.saved_step}"
            raise UpdateLost(
                f"nothing to save as step {step}: this trainer process started from {held} and has taken no step "
                "since (the process that took the update is gone); the update must be taken again"
            )
        path = save_checkpoint(
            self.checkpoint_root, step, self.trainer.model, self.trainer.tokenizer,
            trainer_state=self.trainer.state_dict(), meta=meta, keep_last=keep_last,
        )  # fmt: skip
        self.saved_step, self.pending = step, False
        return str(path)
