"""Prefect flows composed from `tasks`: `train` (the main job, running `training_iteration` and `evaluation`
subflows), `evaluate` and `dev`, which share the rollout phase (`flows/rollouts.py`)."""
