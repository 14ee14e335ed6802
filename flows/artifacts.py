"""The flows' Prefect artifacts: keys named after the run, and tables that change as a run goes, updated in place
(one artifact a flow run, showing the latest rows) instead of a new version per iteration or round."""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.artifacts import TableArtifact, acreate_progress_artifact, aupdate_progress_artifact
from prefect.client.schemas.actions import ArtifactUpdate

from lightning.run import Run


def artifact_key(run: Run, what: str) -> str:
    """An artifact key (lowercase letters, digits and dashes): `demo-training`, `demo-progress`, `demo-summary`."""
    return re.sub(r"[^a-z0-9-]", "-", f"{run.name}-{what}".lower())


async def publish_table(key: str, rows: list[dict[str, Any]], description: str, artifact_id: UUID | None) -> UUID:
    """The table artifact `key` of this flow run with `rows`, updated in place (`artifact_id`: the one published
    before, if this process knows it), so the flow run's Artifacts tab holds one table, the latest; its id. A retried
    flow run (a new process, the same flow run) finds and updates the table its first attempt made."""
    table = TableArtifact(key=key, table=rows, description=description)
    async with get_client() as client:
        if artifact_id is None:
            artifact_id = await _artifact_of_this_flow_run(client, key)
        if artifact_id is None:
            return (await table.acreate(client)).id
        await client.update_artifact(artifact_id, ArtifactUpdate(data=await table.aformat(), description=description))
    return artifact_id


async def publish_progress(key: str, percent: float, description: str, artifact_id: UUID | None) -> UUID:
    """The progress artifact `key` of this flow run at `percent`, updated in place like `publish_table`: a retried
    flow run moves the card its first attempt made instead of leaving it behind at the percentage it stopped at."""
    if artifact_id is None:
        async with get_client() as client:
            artifact_id = await _artifact_of_this_flow_run(client, key)
    if artifact_id is None:
        return await acreate_progress_artifact(percent, key=key, description=description)
    await aupdate_progress_artifact(artifact_id, percent)
    return artifact_id


async def _artifact_of_this_flow_run(client: Any, key: str) -> UUID | None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.runtime import flow_run

    if not flow_run.id:
        return None
    mine = ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
    found = await client.read_artifacts(artifact_filter=mine, sort=ArtifactSort.CREATED_DESC, limit=1)
    return found[0].id if found else None
