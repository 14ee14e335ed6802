"""Log set-up with agent-lightning 0.3's `agentlightning.logging` arguments, for the `lightning` loggers.

`setup` (`lightning.setup_logging`) sends the `lightning` logger hierarchy's lines to stderr, and configures the
loggers named in `apply_to` (a script's own, `__name__`) the same way; the root logger and other libraries' loggers
are left alone unless named. Lines are plain text: `color` is accepted and changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

BASE = "lightning"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_OURS = "_lightning_setup"
"""Marks the handlers `setup_module` made, so that calling it again replaces them instead of adding more."""


def setup_module(
    level: int | str = "INFO",
    *,
    name: str = BASE,
    console: bool = True,
    color: bool | dict[str, Any] = True,
    propagate: bool = False,
    disable_existing_loggers: bool = False,
) -> logging.Logger:
    """The logger `name` at `level`, with a stderr handler (unless `console` is False) that replaces the one an
    earlier call gave it; `propagate`: whether its lines also go to the loggers above it."""
    if disable_existing_loggers:
        for other in logging.root.manager.loggerDict.values():
            if isinstance(other, logging.Logger) and not other.name.startswith(name):
                other.disabled = True
    logger = logging.getLogger(name)
    logger.setLevel(_level(level))
    logger.propagate = propagate
    for handler in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(handler)
    if console:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        setattr(handler, _OURS, True)
        logger.addHandler(handler)
    return logger


def setup(
    level: int | str = "INFO",
    *,
    console: bool = True,
    color: bool | dict[str, Any] = True,
    propagate: bool = False,
    disable_existing_loggers: bool = False,
    capture_warnings: bool = False,
    submodule_levels: dict[str, int | str] | None = None,
    extra_handlers: list[logging.Handler] | None = None,
    formatter: logging.Formatter | None = None,
    apply_to: list[str] | None = None,
    files: str | dict[str, str] | None = None,
) -> None:
    """Configure the `lightning` loggers as agent-lightning's `setup_logging` configures its own: `level`, a stderr
    handler, `submodule_levels` ({"lightning.store": "DEBUG"}), `extra_handlers` added once, `formatter` for the
    handlers that have none, `apply_to` loggers given the same handlers (and not propagating), `files` (a path for
    the base logger, or {logger name: path}), `capture_warnings` to route `warnings` into logging."""
    base = setup_module(
        level,
        console=console,
        color=color,
        propagate=propagate,
        disable_existing_loggers=disable_existing_loggers,
    )
    for handler in extra_handlers or []:
        if handler not in base.handlers:
            base.addHandler(handler)
    if formatter is not None:
        for handler in base.handlers:
            if handler.formatter is None:
                handler.setFormatter(formatter)
    for name, sub_level in (submodule_levels or {}).items():
        logging.getLogger(name).setLevel(_level(sub_level))
    targets = {BASE: files} if isinstance(files, str) else dict(files or {})
    for name, path in targets.items():
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(formatter or logging.Formatter(FORMAT))
        logging.getLogger(name).addHandler(file_handler)
    for name in apply_to or []:
        logger = logging.getLogger(name)
        logger.handlers = list(base.handlers)
        logger.setLevel(base.level)
        logger.propagate = False
    if capture_warnings:
        logging.captureWarnings(True)


def configure_logger(level: int = logging.INFO, name: str = BASE) -> logging.Logger:
    """agent-lightning's older `configure_logger`: the logger `name` at `level`, logging to stderr."""
    return setup_module(level, name=name)


def _level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"setup_logging: unknown level {level!r}; give DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


__all__ = ["configure_logger", "setup", "setup_module"]
