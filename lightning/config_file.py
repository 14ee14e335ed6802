"""A config file as data, before it is a TrainConfig: the YAML read, the command line's dotted overrides applied, and
the run it names. Light (PyYAML and the standard library only), so that `python -m flows.train` can take its run's
lock (`lightning.owner`) before it imports the library, Prefect or torch: a twin of a live run is refused at once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning.errors import ConfigError

DEFAULT_RUN_NAME = "demo"
DEFAULT_OUTPUT_DIR = ".lightning/runs"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping of TrainConfig fields a YAML file holds, or a ConfigError saying what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of TrainConfig fields, not a {type(data).__name__}")
    return data


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """The command line's `FIELD=VALUE` overrides (`--set iterations=3`) as a dict of dotted fields
    (`{"iterations": 3}`); each value is read as YAML: numbers, booleans, lists, mappings."""
    overrides = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"override {pair!r}: write field=value, e.g. algorithm.lr=0.0001")
        overrides[name] = yaml.safe_load(text)
    return overrides


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `data` with each dotted override set: `{"algorithm.lr": 1e-4}` sets `data["algorithm"]["lr"]`."""
    result = copy.deepcopy(dict(data))
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = result
        for part in parents:
            if node.get(part) is None:  # absent, or an optional section left null (algorithm.lora): set it
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {part} is not a mapping")
        node[last] = value
    return result


def named_run(data: Mapping[str, Any]) -> tuple[Path, str]:
    """The run directory and name that config data names (TrainConfig's `run_dir` and `run_name`), unchecked: a
    bad value is the TrainConfig's to refuse."""
    name = str(data.get("run_name") or DEFAULT_RUN_NAME)
    return Path(str(data.get("output_dir") or DEFAULT_OUTPUT_DIR)) / name, name
