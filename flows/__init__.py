"""Prefect flows composed from `tasks`: `train` (the main job, running `training_iteration` and `evaluation`
subflows), `evaluate` and `dev`, which share the rollout phase (`flows/rollouts.py`)."""

import os

# Prefect's temporary server would report usage to Prefect every 10 minutes, and log "Failed to send telemetry" on
# a machine without internet access. A setting the user made stands.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
