"""How the flows run outside a terminal: `setup` (the work pool and the `gpu` limit), `deploy` (prefect.yaml's
deployments, for a process worker) and `serve` (deployments served from one process, no worker needed)."""
