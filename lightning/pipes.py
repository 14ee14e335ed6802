"""A child process the run speaks to in JSON over a pipe (the trainer worker, the runner processes): a message, an
error's reply, and ending the child."""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

CLOSE_TIMEOUT = 10.0
"""Seconds a child asked to close has before it is killed."""


def send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def requests(conn: Connection) -> Iterator[dict[str, Any]]:
    """The child's side: the parent's requests, one at a time, until it asks to close or is gone."""
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return  # the parent is gone
        if request["op"] == "close":
            return
        yield request


def error_reply(exc: Exception) -> dict[str, str]:
    """What a child answers when a request raised: the error and its traceback."""
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def end(process: BaseProcess | None, conn: Connection | None, *, kill: bool) -> int | None:
    """End the child: asked to close (`{"op": "close"}`), killed if it does not within CLOSE_TIMEOUT, or at once with
    `kill`; the pipe closed. Its exit code."""
    if conn is not None and not kill and process is not None and process.is_alive():
        with contextlib.suppress(OSError):
            send(conn, {"op": "close"})
    if process is not None:
        if kill:
            process.kill()
        process.join(CLOSE_TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()
    if conn is not None:
        conn.close()
    return process.exitcode if process is not None else None
