"""Create what the deployments in prefect.yaml need on the Prefect server, unless it exists: the `process` work
pool `lightning-process`, and the concurrency limit of 1 on the `gpu` tag (one `ppo_step` at a time).

    python -m deployments.setup        # against PREFECT_API_URL (or the active profile's server)
    python -m deployments.setup --result-storage /mnt/shared/prefect-results      # or s3://bucket/prefect-results

Finished stages' results are what a retried run gets back instead of running them again (`Cached`). By default
Prefect keeps them under the worker's own ~/.prefect/storage, so a retry that lands on another worker machine runs
them again. `--result-storage` gives the pool's flow runs a place every worker sees: a directory on a shared file
system, or a URL of a file system fsspec knows (s3://, gs://, ...; its package, e.g. s3fs, installed on the workers).
"""

from __future__ import annotations

import argparse
import asyncio

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

from tasks.stages import GPU_TAG  # the tag ppo_step takes where this limit exists

WORK_POOL = "lightning-process"
GPU_LIMIT = 1
RESULTS_BLOCK = "lightning-results"
RESULT_STORAGE_ENV = ("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK")
"""Prefect's settings that say where a flow run keeps its results: a directory, or a file system block."""


async def setup(result_storage: str | None = None) -> None:
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
        if result_storage is not None:
            env = await _result_storage_env(result_storage)
            pool = await client.read_work_pool(WORK_POOL)
            template = pool.base_job_template
            default_env = template["variables"]["properties"]["env"].setdefault("default", {}) or {}
            for earlier in RESULT_STORAGE_ENV:  # the new place replaces the one set before, of either kind
                default_env.pop(earlier, None)
            default_env.update(env)
            template["variables"]["properties"]["env"]["default"] = default_env
            await client.update_work_pool(WORK_POOL, WorkPoolUpdate(base_job_template=template))
            print(f"work pool {WORK_POOL}: flow runs keep stage results in {result_storage} ({', '.join(env)})")


async def _result_storage_env(where: str) -> dict[str, str]:
    """The environment that points a flow run's persisted results at `where`: a directory (absolute; made now), or a
    file system URL, kept as the `remote-file-system/lightning-results` block."""
    from pathlib import Path

    scheme = where.partition("://")[0] if "://" in where else ""
    if scheme in ("", "file"):
        path = Path(where.removeprefix("file://")).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return {RESULT_STORAGE_ENV[0]: str(path)}
    from prefect.filesystems import RemoteFileSystem

    await RemoteFileSystem(basepath=where).save(RESULTS_BLOCK, overwrite=True)
    return {RESULT_STORAGE_ENV[1]: f"remote-file-system/{RESULTS_BLOCK}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.setup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--result-storage",
        help="where flow runs of the pool keep finished stages' results: a shared directory or an fsspec URL",
    )
    args = parser.parse_args(argv)
    asyncio.run(setup(args.result_storage))


if __name__ == "__main__":
    main()
