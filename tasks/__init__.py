"""Prefect tasks: each a thin wrapper over one `lightning` call (arrives with the pipeline issue)."""
