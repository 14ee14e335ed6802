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
    """`url` without its credentials, and the secret they carried: the password, else the user name
    (`http://:TOKEN@host:4747` gives (`http://host:4747`, TOKEN)), or a store server's token as the path's first part
    (`http://host:4747/t/TOKEN`, the form agent-lightning's client takes). A URL without them comes back as is, with
    None."""
    parts = urlsplit(url)
    in_path = parts.scheme in ("http", "https") and parts.path.startswith(PATH_TOKEN)
    if parts.username is None and parts.password is None and not in_path:
        return url, None
    secret = unquote(parts.password or parts.username or "") or None
    parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    if in_path:
        token, _, rest = parts.path.removeprefix(PATH_TOKEN).partition("/")
        secret = secret or unquote(token) or None
        parts = parts._replace(path=f"/{rest}" if rest else "")
    return urlunsplit(parts), secret


PATH_TOKEN = "/t/"
"""A store server's token as the first part of the path (`http://host:4747/t/TOKEN/...`): agent-lightning's client
cannot send a header."""
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@'\"]*)(?::(?P<password>[^/\s@'\"]*))?@"
)
_IN_PATH = re.compile(r"(?P<head>\bhttps?://[^/\s'\"]+/t/)(?P<token>[^/\s'\"?#]+)")
MASK = "***"


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it masked: a password (`postgresql://user:***@db`), a token given
    as the user of an http(s) URL (`http://***@host`, `http://:***@host`) or as its path's first part
    (`http://host:4747/t/***`). A `${...}` reference is no secret and stays. What prints, logs or stores a URL passes
    it through here first."""

    def userinfo(match: re.Match[str]) -> str:
        scheme, user, password = match.group("scheme"), match.group("user"), match.group("password")
        if password is not None:
            return f"{scheme}{user}:{_masked(password)}@"
        return f"{scheme}{_masked(user) if scheme.lower().startswith('http') else user}@"

    text = _USERINFO.sub(userinfo, text)
    return _IN_PATH.sub(lambda match: match.group("head") + _masked(match.group("token")), text)


def _masked(secret: str) -> str:
    return secret if not secret or REFERENCE.fullmatch(secret) else MASK


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
