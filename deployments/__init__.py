"""How flows are served and deployed: work pools, entry points, schedules (arrives with the pipeline issue)."""
