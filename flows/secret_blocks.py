"""Prefect Secret blocks named in a config's URLs (`${secret:NAME}`): their values go into this process's
environment (`LIGHTNING_SECRET_<NAME>`), where the library reads them when it connects and the run's child
processes inherit them. The config itself, which Prefect stores as the flow run's parameter, keeps the reference."""

from __future__ import annotations

import os

from prefect.blocks.system import Secret

from lightning.config import TrainConfig
from lightning.credentials import references, secret_env_name

URL_FIELDS = ("store_url", "tracking_uri")


async def export_secret_blocks(config: TrainConfig) -> list[str]:
    """Load each Secret block the config's URLs name into the environment; the names of those loaded."""
    loaded = []
    for field in URL_FIELDS:
        for kind, name in references(getattr(config, field)):
            if kind == "secret" and secret_env_name(name) not in os.environ:
                block = await Secret.aload(name)
                os.environ[secret_env_name(name)] = str(block.get())
                loaded.append(name)
    return loaded
