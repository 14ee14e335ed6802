"""The `lightning.flows` entry point (pyproject.toml): `lightning.Trainer`'s fit and dev hand their config to the
`train`, `dev` or `optimize_prompt` flow here, so that the library itself never imports Prefect or the flows. No
flow imports this module."""

from __future__ import annotations

from typing import Any

from flows.cli import temporary_prefect_server
from flows.dev import dev
from flows.optimize_prompt import optimize_prompt
from flows.train import train

FLOWS = {"train": train, "dev": dev, "optimize_prompt": optimize_prompt}


async def run_flow(flow_name: str, config: Any) -> Any:
    """Run the `train`, `dev` or `optimize_prompt` flow (agl's `APO`) on `config` in this event loop, on a temporary
    Prefect server unless PREFECT_API_URL names one."""
    with temporary_prefect_server(config.run_dir / "logs" / "prefect-server.log", config.timeouts.startup):
        return await FLOWS[flow_name](config)
