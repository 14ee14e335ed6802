"""Secrets kept out of configs: a URL (`store_url`, `tracking_uri`, a store server's database) may name its password
as `${VAR}`, an environment variable, or `${secret:NAME}`, a Prefect Secret block that the flows put in the
environment as `LIGHTNING_SECRET_<NAME>` before the run opens. The reference is expanded only where a connection is
made, so the config that Prefect stores, MLflow logs and command lines show holds the reference, never the value;
child processes inherit the environment, not the secret on their command line.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections.abc import Callable
from urllib.parse import unquote, urlsplit, urlunsplit

from lightning.environment import PROXY_TOKEN, SECRET_PREFIX

REFERENCE = re.compile(r"\$\{(?:(secret):)?([A-Za-z_][A-Za-z0-9_-]*)\}")


class MissingSecret(KeyError):
    """A `${...}` reference names nothing in the environment."""

    def __str__(self) -> str:
        return str(self.args[0])


def secret_env_name(name: str) -> str:
    """The environment variable that holds Prefect Secret block `name` for this process and its children."""
    return SECRET_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def references(text: str) -> list[tuple[str, str]]:
    """The `${...}` references in `text`, as (kind, name): kind "" (environment variable) or "secret"."""
    return [(kind or "", name) for kind, name in REFERENCE.findall(text)]


def expand(text: str) -> str:
    """`text` with each `${VAR}` replaced by the variable's value and each `${secret:NAME}` by the Secret block's;
    a reference to nothing is an error naming it and where to set it."""

    def value(match: re.Match[str]) -> str:
        kind, name = match.group(1), match.group(2)
        variable = secret_env_name(name) if kind == "secret" else name
        if variable not in os.environ:
            where = (
                f"a Prefect Secret block {name!r} (the flows put it in ${variable}), or ${variable} itself"
                if kind == "secret"
                else f"the environment variable ${name}"
            )
            raise MissingSecret(f"{match.group(0)} names {where}, which is not set")
        return os.environ[variable]

    return REFERENCE.sub(value, text)


def split_credentials(url: str) -> tuple[str, str | None]:
    """`url` without its user and password, and the secret they carried (the password, else the user name):
    `http://:TOKEN@host:4747` gives (`http://host:4747`, TOKEN). A URL without them comes back as is, with None."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    secret = unquote(parts.password or parts.username or "") or None
    return urlunsplit(parts._replace(netloc=host)), secret


# --- the run's LLM proxy token -----------------------------------------------------------------------

_token_lock = threading.Lock()
_runs_sharing_token = 0
"""Open runs of this process that share the proxy token in its environment (one token a process: its runners sign
their agents' routes with it); the last to close takes it out again."""


def claim_proxy_token() -> tuple[str, Callable[[], None]]:
    """The token for a run's LLM proxy, and its release. It lives in this process's environment
    ($LIGHTNING_PROXY_TOKEN), where the runners of this process, and the runner processes it spawns, read it to sign
    their agents' routes: the store's resources never hold it (anyone who reads the store could call the models and
    write spans). Runs open at once in one process share one token, chosen and handed over in one step (two runs that
    each chose their own would leave one run's runners signing with the other's token). A token the user set there
    stays as it is; one the run set goes again when the last run using it releases it, leaving no trace."""
    global _runs_sharing_token
    with _token_lock:
        token = os.environ.get(PROXY_TOKEN)
        if token and not _runs_sharing_token:
            return token, lambda: None  # the user's own
        if not token:
            token = os.environ[PROXY_TOKEN] = secrets.token_urlsafe(24)
        _runs_sharing_token += 1

    def release() -> None:
        global _runs_sharing_token
        with _token_lock:
            _runs_sharing_token -= 1
            if not _runs_sharing_token:
                os.environ.pop(PROXY_TOKEN, None)

    return token, release
