"""agent-lightning's `env_var` helpers over this project's environment: `LightningEnvVar` names agl's variables and
ours (lightning.environment), and `resolve_bool_env_var` / `resolve_int_env_var` / `resolve_str_env_var` read one
as agl's do: the caller's override first, then the variable, then the fallback."""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from lightning import environment


class LightningEnvVar(Enum):
    """The environment variables a script may read: agl's five (with what each means here), then ours."""

    AGL_EMITTER_DEBUG = "AGL_EMITTER_DEBUG"
    """agl: debug logs of the emitters. Read by nothing here: `lightning.setup_logging("DEBUG")` shows ours."""
    AGL_MANAGED_STORE = "AGL_MANAGED_STORE"
    """agl: whether the trainer wraps the store it is given. Read by nothing here: the Trainer never wraps a store
    (a `store=` is a URL that every process of the run opens), so 0 and 1 run alike."""
    AGL_CURRENT_ROLE = "AGL_CURRENT_ROLE"
    """agl: which side of the training this process runs (`algorithm`, `runner` or `both`). `Trainer.fit` runs both
    (unset or `both`) and refuses the others, saying how to run runners apart here."""
    AGL_SERVER_HOST = "AGL_SERVER_HOST"
    """agl: where the trainer's store server listens. Read by nothing here: a run starts no store server (its
    processes open the store by URL); `lightning store serve --host` serves one."""
    AGL_SERVER_PORT = "AGL_SERVER_PORT"
    """agl: the port of the trainer's store server. Read by nothing here: `lightning store serve --port`."""

    LIGHTNING_STORE_TOKEN = environment.STORE_TOKEN
    LIGHTNING_STORE_DB = environment.STORE_DB
    LIGHTNING_STORE_URL = environment.STORE_URL
    LIGHTNING_PROXY_TOKEN = environment.PROXY_TOKEN
    LIGHTNING_BACKEND_API_KEY = environment.BACKEND_API_KEY
    LIGHTNING_INFERENCE_API_KEY = environment.INFERENCE_API_KEY
    LIGHTNING_STACKS_DIR = environment.STACKS_DIR
    LIGHTNING_EXIT_WITH_PARENT = environment.EXIT_WITH_PARENT
    LIGHTNING_VLLM_PYTHON = environment.VLLM_PYTHON
    LIGHTNING_FAULTS = environment.FAULTS
    LIGHTNING_PREFECT_UI_URL = environment.PREFECT_UI


TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
FALSE_VALUES = frozenset({"0", "false", "no", "off"})
T = TypeVar("T")


def _resolve(env_var: LightningEnvVar, override: T | None, fallback: T | None, parse: Callable[[str], T]) -> T | None:
    """The rule of all three: the override if given, else the variable parsed if set, else the fallback."""
    if override is not None:
        return override
    value = os.environ.get(env_var.value)
    return fallback if value is None else parse(value)


def resolve_bool_env_var(
    env_var: LightningEnvVar, override: bool | None = None, fallback: bool | None = None
) -> bool | None:
    """`override` if given, else the variable read as a bool (1/true/yes/on, 0/false/no/off, any case; anything else
    is a ValueError), else `fallback`."""

    def parse(value: str) -> bool:
        normalized = value.strip().lower()
        if normalized in TRUE_VALUES or normalized in FALSE_VALUES:
            return normalized in TRUE_VALUES
        raise ValueError(f"{env_var.value}={value!r}: give one of {sorted(TRUE_VALUES)} or {sorted(FALSE_VALUES)}")

    return _resolve(env_var, override, fallback, parse)


def resolve_int_env_var(
    env_var: LightningEnvVar, override: int | None = None, fallback: int | None = None
) -> int | None:
    """`override` if given, else the variable as an integer (anything else is a ValueError), else `fallback`."""

    def parse(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{env_var.value}={value!r}: give an integer") from None

    return _resolve(env_var, override, fallback, parse)


def resolve_str_env_var(
    env_var: LightningEnvVar, override: str | None = None, fallback: str | None = None
) -> str | None:
    """`override` if given, else the variable as it is (an empty string included), else `fallback`."""
    return _resolve(env_var, override, fallback, str)


__all__ = ["LightningEnvVar", "resolve_bool_env_var", "resolve_int_env_var", "resolve_str_env_var"]
