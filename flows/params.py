"""The flows' two parameters: `config`, the run's TrainConfig (a deployment's is its default), and `overrides`,
dotted fields changed for this run only (`{"iterations": 3, "algorithm.lr": 1e-4}`), as `--set` does on the CLI:

    prefect deployment run 'train/demo' --param overrides='{"iterations": 3}'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect.runtime import flow_run

from flows.secret_blocks import export_secret_blocks
from lightning.config import TrainConfig, with_overrides
from tasks.caching import TRAIN_FLOW_RUN_ID

OVERRIDES_HELP = 'dotted fields of `config` to change for this run, e.g. {"iterations": 3, "algorithm.lr": 1e-4}'


def effective_config(config: TrainConfig | dict[str, Any], overrides: dict[str, Any] | None) -> TrainConfig:
    return with_overrides(config, overrides)


async def flow_prologue(config: TrainConfig | dict[str, Any], overrides: dict[str, Any] | None) -> TrainConfig:
    """What every top-level flow does first: its config with the overrides applied (a bad one is a ConfigError
    naming the field), this flow run recorded as the one whose id keys its stages' cache (`tasks.caching`), and the
    Prefect Secret blocks the config's URLs name loaded into the environment."""
    config = effective_config(config, overrides)
    TRAIN_FLOW_RUN_ID.set(str(flow_run.get_id()))
    await export_secret_blocks(config)
    return config


def flow_run_name(suffix: str = "") -> Callable[[], str]:
    """A flow run's name: the run name of its config with its overrides applied, then `suffix`."""

    def name() -> str:
        parameters = flow_run.parameters
        config = parameters.get("config") or TrainConfig()
        try:
            run_name = effective_config(config, parameters.get("overrides")).run_name
        except ValueError:  # the flow itself reports a bad config; the name falls back to the given one
            run_name = config.run_name if isinstance(config, TrainConfig) else str(config.get("run_name", "demo"))
        return run_name + suffix

    return name
