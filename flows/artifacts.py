"""The flows' Prefect artifacts: keys named after the run, and tables that change as a run goes, updated in place
(one artifact a flow run, showing the latest rows) instead of a new version per iteration or round."""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.artifacts import TableArtifact
from prefect.client.schemas.actions import ArtifactUpdate

from lightning.run import Run


def artifact_key(run: Run, what: str) -> str:
    """An artifact key (lowercase letters, digits and dashes): `demo-training`, `demo-progress`, `demo-summary`."""
    return re.sub(r"[^a-z0-9-]", "-", f"{run.name}-{what}".lower())


async def publish_table(key: str, rows: list[dict[str, Any]], description: str, artifact_id: UUID | None) -> UUID:
    """The table artifact `key` of this flow run with `rows`: created the first time (`artifact_id` None), then
    updated in place, so the flow run's Artifacts tab holds one table, the latest; its id."""
    table = TableArtifact(key=key, table=rows, description=description)
    if artifact_id is None:
        return (await table.acreate()).id
    async with get_client() as client:
        await client.update_artifact(artifact_id, ArtifactUpdate(data=await table.aformat(), description=description))
    return artifact_id
