"""JSON on the hot paths of the LLM proxy and the embedded inference server: orjson, several times faster than the
json module (JSON was 13% of the server-and-proxy process's time on the demo's calls, issue 39), with the json module
for what orjson refuses, so that nothing the json module writes or reads fails here.

Two differences remain, both on values JSON has no place for: NaN and infinity are written as null (the json module
writes `NaN`, which is not JSON, and a JSON response of Starlette's refuses them), and `loads` reads an integer past
64 bits as a float. So `loads` is for answers of inference servers (ids, token ids, log-probs), not for requests,
whose fields (a seed) are the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """`value` as compact UTF-8 JSON; `default` makes JSON of what is not (as the json module's)."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:  # an integer past 64 bits, a key that is not a string
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=default).encode()


def loads(raw: bytes | str) -> Any:
    """An inference server's answer, parsed; what orjson refuses (`NaN`, `Infinity`) is read by the json module,
    whose error (a `json.JSONDecodeError`, a ValueError) stands."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
