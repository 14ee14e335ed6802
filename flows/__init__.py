"""Prefect flows composed from `tasks` (arrives with the pipeline issue)."""
