"""The run's servers log no line per call unless asked (`inference.access_log`, `lightning proxy serve --access-log`):
thousands of calls a minute, each line 5-6% of a server's CPU (issue 39)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning import cli
from lightning.config import TrainConfig
from lightning.stack import LocalStack


def _commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **kwargs: Any) -> dict[str, list[str]]:
    """The commands a LocalStack starts its two server processes with (nothing is started)."""
    commands: dict[str, list[str]] = {}

    def start(stack: Any, name: str, command: list[str], *_: Any) -> str:
        commands[name] = command
        return "http://127.0.0.1:9"

    monkeypatch.setattr(LocalStack, "_start_process", start)
    LocalStack(
        None, tmp_path, server="process", proxy="process", store_url=f"sqlite:///{tmp_path}/store.db",
        log_dir=tmp_path, start_timeout=1.0, **kwargs,
    )  # type: ignore[arg-type]  # fmt: skip
    return commands


def test_the_run_servers_log_no_line_per_call_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert TrainConfig(agent="examples.copy_task.agent:copy_agent").inference.access_log is False
    quiet = _commands(monkeypatch, tmp_path)
    assert set(quiet) == {"inference server", "LLM proxy"}
    assert not any("--access-log" in command for command in quiet.values())
    logged = _commands(monkeypatch, tmp_path, access_log=True)
    assert all("--access-log" in command for command in logged.values())


@pytest.mark.parametrize(
    ("flags", "log_level", "access_log"), [([], "warning", False), (["--access-log"], "info", True)]
)
def test_proxy_serve_access_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], log_level: str, access_log: bool
) -> None:
    import uvicorn

    ran: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(kwargs))
    monkeypatch.setattr(cli, "exit_with_parent", lambda *_: None)
    monkeypatch.setattr(cli, "dump_stacks_on_signal", lambda *_: None)
    store = f"sqlite:///{tmp_path}/store.db"
    assert cli.main(["proxy", "serve", "--backend", "http://127.0.0.1:9/v1", "--store", store, *flags]) == 0
    assert (ran["log_level"], ran["access_log"]) == (log_level, access_log)
