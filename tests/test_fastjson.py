"""lightning.fastjson: orjson where it can, the json module for what orjson refuses, and the two differences left."""

from __future__ import annotations

import json

import pytest

from lightning import fastjson


def test_dumps_is_compact_utf8_json_and_falls_back_for_what_orjson_refuses() -> None:
    value = {"text": "é", "ids": [1, 2], "p": -0.25, "none": None}
    assert fastjson.dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert json.loads(fastjson.dumps({"seed": 2**70})) == {"seed": 2**70}  # past 64 bits: the json module
    assert json.loads(fastjson.dumps({1: "a"})) == {"1": "a"}  # a key that is not a string
    assert fastjson.dumps({"x": float("nan")}) == b'{"x":null}'  # JSON has no NaN
    assert fastjson.dumps([object()], default=lambda _: "o") == b'["o"]'


def test_loads_reads_answers_and_what_orjson_refuses_through_the_json_module() -> None:
    assert fastjson.loads(b'{"choices":[{"logprobs":{"content":[{"logprob":-1.5}]}}]}')["choices"][0]
    assert fastjson.loads(b'{"logprob": -Infinity}') == {"logprob": float("-inf")}
    with pytest.raises(json.JSONDecodeError):
        fastjson.loads(b"not json")
