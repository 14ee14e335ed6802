"""The environment variables the project reads, or sets for the processes it starts: each named once, here, with
what it is for. Secrets travel this way (never on a command line, which `ps` shows to every user)."""

from __future__ import annotations

import os

STORE_TOKEN = "LIGHTNING_STORE_TOKEN"
"""The store server's bearer token: `lightning store serve`, its clients, runners, Ray workers."""
STORE_DB = "LIGHTNING_STORE_DB"
"""`lightning store serve`'s database URL (keeps a password off the command line)."""
STORE_URL = "LIGHTNING_STORE_URL"
"""The store a process the run starts opens (its LLM proxy), or `lightning proxy serve`'s default."""
PROXY_TOKEN = "LIGHTNING_PROXY_TOKEN"
"""The LLM proxy's bearer token (a run's own is random unless this names one)."""
BACKEND_API_KEY = "LIGHTNING_BACKEND_API_KEY"
"""The API key the proxy sends to its inference backends."""
INFERENCE_API_KEY = "LIGHTNING_INFERENCE_API_KEY"
"""The embedded inference server's API key."""
STACKS_DIR = "LIGHTNING_STACKS_DIR"
"""Where a run's child processes write their Python stacks on SIGUSR1 (`lightning.diagnose`)."""
EXIT_WITH_PARENT = "LIGHTNING_EXIT_WITH_PARENT"
"""The pid a child process watches, to end with it (`lightning.lifeline`)."""
VLLM_PYTHON = "LIGHTNING_VLLM_PYTHON"
"""The Python of vLLM's own environment (`make vllm-cpu`), for `inference.backend: vllm`."""
SECRET_PREFIX = "LIGHTNING_SECRET_"
"""`${secret:NAME}` in a config's URL reads LIGHTNING_SECRET_<NAME> (the flows load Prefect Secret blocks there)."""
FAULTS = "LIGHTNING_FAULTS"
"""Fault drills of the flows' tasks: `stage@iteration[,...]` (tasks/stages.py)."""
PREFECT_UI = "LIGHTNING_PREFECT_UI_URL"
"""Set by `python -m flows.*` on its temporary Prefect server (which has no UI): the UI that shows its flow runs."""
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
"""MLflow's own: the tracking store when none is given."""
LITELLM_OFFLINE = "LITELLM_LOCAL_MODEL_COST_MAP"
"""LiteLLM's own: read its model price list from the package instead of fetching it from the internet at import."""


def litellm_offline() -> None:
    """Keep LiteLLM (which MLflow's store and UI, the proxy's external route and APO import) from fetching its price
    list from the internet (minutes offline); call before it is imported. A value already set is left alone."""
    os.environ.setdefault(LITELLM_OFFLINE, "True")
