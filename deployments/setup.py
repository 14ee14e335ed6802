"""Create what the deployments in prefect.yaml need on the Prefect server, unless it exists: the `process` work
pool `lightning-process`, and the concurrency limit of 1 on the `gpu` tag (one `ppo_step` at a time).

    python -m deployments.setup        # against PREFECT_API_URL (or the active profile's server)
"""

from __future__ import annotations

import argparse
import asyncio

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

WORK_POOL = "lightning-process"
GPU_TAG = "gpu"
GPU_LIMIT = 1


async def setup() -> None:
    async with get_client() as client:
        try:
            await client.read_work_pool(WORK_POOL)
            print(f"work pool {WORK_POOL} exists")
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            await client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process", base_job_template=template))
            print(f"created work pool {WORK_POOL} (type process)")
        try:
            limit = await client.read_concurrency_limit_by_tag(GPU_TAG)
            print(f"concurrency limit on tag {GPU_TAG!r} exists ({limit.concurrency_limit})")
        except ObjectNotFound:
            await client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=GPU_LIMIT)
            print(f"created concurrency limit {GPU_LIMIT} on tag {GPU_TAG!r}")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m deployments.setup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    asyncio.run(setup())


if __name__ == "__main__":
    main()
