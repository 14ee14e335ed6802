"""One connection to Ray per run's process, shared by the runner tasks (prefect-ray) and the verl trainer actor.

prefect-ray connects and disconnects around each flow it runs, and every connection is a new Ray job whose worker
processes start and import everything again (about 10 s an iteration on 2 cores). Connected once here, before
the iterations, it reuses this connection and leaves it open; the run closes it at the end.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.environment import PROXY_TOKEN, STORE_TOKEN

FORWARDED_ENV = (STORE_TOKEN, PROXY_TOKEN)
"""Variables Ray workers get from the run's process (through the job's runtime_env), when set there: the tokens
of the store server and of the LLM proxy. Nodes started with them in their environment need not rely on it."""


def worker_env() -> dict[str, str]:
    """The environment Ray workers of this run get: the forwarded tokens and this checkout on PYTHONPATH."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return env


def connect(address: str | None, namespace: str = "lightning", **init_kwargs: Any) -> bool:
    """Connect this process to the Ray cluster at `address` (None: RAY_ADDRESS, a cluster `ray start` left on this
    machine, or a new local one) unless it is connected already; whether this call connected."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, namespace=namespace, runtime_env={"env_vars": worker_env()}, **init_kwargs)
    return True


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
