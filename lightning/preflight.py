"""What can be checked of a training run in seconds, before anything starts: the datasets load, the agent and
the demonstrations import, the model directory has a config and a tokenizer, the store answers, the URLs'
secrets and the API keys the config names are set, a GPU named by algorithm.device or inference.device is there.
`lightning config check` and the flows run it first; each problem is one line."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from lightning.config import TrainConfig, load_agent, load_entry_point, load_tasks, missing_data
from lightning.credentials import MissingSecret, expand, redact
from lightning.devices import resolve_device
from lightning.errors import ConfigError
from lightning.store import open_store

STORE_TIMEOUT = 5.0


def problems(config: TrainConfig, optimiser: bool = False, training: bool = True) -> list[str]:
    """One line per thing that would stop `config`'s run; empty when it can start. `optimiser`: the run optimises
    its prompt (`optimize_prompt`), so the optimiser's key must be set too. `training`: the run trains (or runs its
    training tasks: `dev`), so `train_data` must be set; `evaluate` needs only `val_data`."""
    found: list[str] = []
    inference = config.inference
    if inference.api_key_env and inference.endpoint and not os.environ.get(inference.api_key_env):
        found.append(
            f"inference.api_key_env: the environment variable {inference.api_key_env} (the API key of "
            f"{redact(inference.endpoint)}) is not set; every rollout would fail without it"
        )
    if optimiser and config.apo is not None and config.apo.api_key_env and not os.environ.get(config.apo.api_key_env):
        found.append(
            f"apo.api_key_env: the environment variable {config.apo.api_key_env} (the optimiser's key) is not set"
        )
    if training and config.train_data is None:
        found.append(missing_data("train_data"))
    for field in ("train_data", "val_data"):
        spec = getattr(config, field)
        if spec is not None:
            _check(found, field, lambda spec=spec, field=field: load_tasks(spec, field))
    _check(found, "agent", lambda: load_agent(config.agent))
    if config.warm_start is not None:
        spec = config.warm_start.demonstrations
        _check(found, "warm_start.demonstrations", lambda: load_entry_point(spec, "warm_start.demonstrations"))
    if config.apo is not None:  # the seed prompt loads (and parses: `lightning.apo` checks its placeholders)
        _check(found, "apo.initial_prompt_from", config.apo.seed)
    if config.model != "tiny":
        _check(found, "model", lambda: _model_problem(Path(config.model)))
    for field in ("store_url", "tracking_uri"):
        _check(found, field, lambda field=field: expand(getattr(config, field)))
    if not any(line.startswith("store_url:") for line in found):
        _check(found, "store_url", lambda: _store_problem(config.store_url))
    for field, setting in _devices(config):
        _check(found, field, lambda field=field, setting=setting: resolve_device(setting, field))
    return found


def _devices(config: TrainConfig) -> list[tuple[str, str]]:
    """The device settings this run's own processes take, where one names a device (auto always resolves)."""
    devices = []
    if config.trainer_backend == "torch":
        devices.append(("algorithm.device", config.algorithm.device))
    if config.inference.backend == "embedded" and not (config.inference.endpoint or config.proxy_endpoint):
        devices.append(("inference.device", config.inference.device))
    return [(field, setting) for field, setting in devices if setting != "auto"]


_passed: tuple[str, bool, bool] | None = None
"""The config this process last found ready (as JSON), whether with the optimiser's key, and whether to train."""


def check(config: TrainConfig, optimiser: bool = False, training: bool = True) -> None:
    """Raise ConfigError listing every problem (one line each) if there is any. Once per config in a process: the
    command checks it before Prefect starts (`flows.cli`, `Trainer.fit`), and `Run.open`, where deployments and
    scripts are checked, then finds it done."""
    global _passed
    key = config.model_dump_json()
    if _passed is not None and _passed[0] == key and (_passed[1] or not optimiser) and (_passed[2] or not training):
        return
    found = problems(config, optimiser, training)
    if found:
        raise ConfigError("the run cannot start:\n" + "\n".join(f"  {line}" for line in found))
    _passed = (key, optimiser, training)


def _check(found: list[str], field: str, attempt: Any) -> None:
    try:
        attempt()
    except (ConfigError, MissingSecret) as exc:
        message = redact(str(exc))  # a library's error may quote the URL it was given, its password with it
        found.append(message if message.startswith(f"{field}:") else f"{field}: {message}")
    except Exception as exc:
        found.append(f"{field}: {type(exc).__name__}: {_one_line(redact(str(exc)))}")


def _model_problem(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {path} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig, AutoTokenizer

    from lightning.models.files import no_progress_bars

    with no_progress_bars():
        AutoConfig.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)


def _store_problem(url: str) -> None:
    """The store answers within STORE_TIMEOUT seconds (a SQLite file: its directory can be made and written)."""
    if url.startswith("sqlite:///") and url not in ("sqlite:///:memory:",):
        path = Path(url.removeprefix("sqlite:///").split("?", 1)[0])
        path.parent.mkdir(parents=True, exist_ok=True)

    async def ask() -> None:
        store = open_store(url, watchdog_interval=None)
        try:
            await asyncio.wait_for(store.statistics(), timeout=STORE_TIMEOUT)
        finally:
            await store.close()

    # On a thread of its own, so that a database that never answers (a connect that hangs) costs STORE_TIMEOUT.
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: outcome.append(_run(ask)), name="preflight-store", daemon=True)
    thread.start()
    thread.join(STORE_TIMEOUT + 1)
    if not outcome:
        raise ConfigError(f"store_url: no answer from the store within {STORE_TIMEOUT:g} s")
    if outcome[0] is not None:
        raise outcome[0]


def _run(ask: Any) -> BaseException | None:
    try:
        asyncio.run(ask())
    except TimeoutError:
        return ConfigError(f"store_url: no answer from the store within {STORE_TIMEOUT:g} s")
    except BaseException as exc:
        return exc
    return None


def _one_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return first if len(first) <= 300 else first[:297] + "..."
