"""Screenshots of what a user sees in the Prefect and MLflow UIs after a short training run, taken with headless
Chromium driven by Playwright (`apt-get install chromium` and `pip install -e '.[screenshots]'`), for
docs/images/.

    .venv/bin/python benchmarks/screenshots.py [--out docs/images]

It starts a Prefect server (UI on), deploys the flows, runs a 6-iteration train flow from the `train/demo`
deployment through a process worker with `overrides`, starts an MLflow UI on the run's tracking database, and
saves: Prefect's run form (descriptions), the flow run's artifacts (progress, summary), MLflow's run page and its
traces view. Everything listens on 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
OVERRIDES = {
    "run_name": "screenshots", "iterations": 6, "batch_size": 16, "samples_per_task": 8, "eval_every": 3,
}  # fmt: skip
"""The deployment's demo config, shortened: 6 iterations after its warm start, held-out rewards at 0, 3 and 6."""


def wait_for(url: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status < 500:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {seconds:g} s")


def api_get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as answer:
        return json.loads(answer.read())


def artifact_id(base: str, key: str) -> str:
    """The newest version of an artifact key (its own page renders the markdown or table; the key's page lists
    versions only)."""
    request = urllib.request.Request(
        base + "/artifacts/filter", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1}).encode(),
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())[0]["id"]


class Camera:
    """Headless Chromium driven by Playwright: open a page, click what hides the content, wait, save."""

    def __init__(self, chromium: str) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        self._page = self._browser.new_page(viewport={"width": 1440, "height": 1000}, color_scheme="light")

    def shoot(self, url: str, out: Path, clicks: tuple[str, ...] = (), settle_s: float = 6.0) -> None:
        page = self._page
        page.goto(url, wait_until="load", timeout=120_000)
        page.wait_for_timeout(settle_s * 1000)
        for selector in clicks:
            for element in page.locator(selector).all():
                if element.is_visible():
                    element.click()
                    page.wait_for_timeout(1500)
        page.wait_for_timeout(2000)
        page.screenshot(path=str(out))
        print(f"saved {out} ({url})")

    def close(self) -> None:
        self._browser.close()
        self._playwright.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "docs" / "images"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lightning-screens-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env["PREFECT_API_URL"] = "http://127.0.0.1:4321/api"
    env["PREFECT_UI_API_URL"] = env["PREFECT_API_URL"]
    processes: list[subprocess.Popen] = []
    try:
        log = open(work / "server.log", "w")  # noqa: SIM115 (closed with the process)
        server = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", "4321"]
        processes.append(subprocess.Popen(server, env=env, stdout=log, stderr=log, cwd=work))
        wait_for("http://127.0.0.1:4321/api/health")
        subprocess.run([PY, "-m", "deployments.deploy"], env=env, cwd=REPO, check=True, timeout=300)
        worker_log = open(work / "worker.log", "w")  # noqa: SIM115
        worker = [str(BIN / "prefect"), "worker", "start", "--pool", "lightning-process"]
        processes.append(subprocess.Popen(worker, env=env, stdout=worker_log, stderr=worker_log, cwd=work))

        base = env["PREFECT_API_URL"]
        overrides = {**OVERRIDES, "output_dir": str(work / "runs"), "store_url": f"sqlite:///{work / 'store.db'}",
                     "tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}  # fmt: skip
        started = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", "train/demo", "--param", f"overrides={json.dumps(overrides)}"],
            env=env, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            state = api_get(base, f"/flow_runs/{flow_run_id}")
            if state["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(5)
        print("flow run ended:", state["state"]["type"])

        deployment = api_get(base, "/deployments/name/train/demo")
        camera = Camera(args.chromium)
        ui = "http://127.0.0.1:4321"
        camera.shoot(f"{ui}/deployments/deployment/{deployment['id']}/run", out / "prefect-run-form.png")
        camera.shoot(f"{ui}/runs/flow-run/{flow_run_id}", out / "prefect-artifacts.png", clicks=("text=Artifacts",))
        for key in ("screenshots-summary", "screenshots-progress"):
            camera.shoot(f"{ui}/artifacts/artifact/{artifact_id(base, key)}", out / f"prefect-{key.split('-')[-1]}.png")

        mlflow_log = open(work / "mlflow.log", "w")  # noqa: SIM115
        mlflow = [str(BIN / "mlflow"), "ui", "--backend-store-uri", overrides["tracking_uri"], "--host", "127.0.0.1",
                  "--port", "5321"]  # fmt: skip
        processes.append(subprocess.Popen(mlflow, env=env, stdout=mlflow_log, stderr=mlflow_log, cwd=work))
        wait_for("http://127.0.0.1:5321/health")
        import mlflow as mlflow_client

        client = mlflow_client.MlflowClient(overrides["tracking_uri"])
        experiment = client.get_experiment_by_name("lightning")
        (run,) = client.search_runs([experiment.experiment_id], max_results=1)
        trace = client.search_traces(locations=[experiment.experiment_id], max_results=1)[0]
        page = f"http://127.0.0.1:5321/#/experiments/{experiment.experiment_id}"
        # MLflow's UI opens in its GenAI mode, with a tour pop-up and an assistant panel over the content: switch to
        # its model-training mode once (the page remembers it), then close what covers the pages.
        tidy = ('button:has-text("Got it")', 'button[aria-label="Close"]')
        camera.shoot(f"{page}/runs", out / "mlflow-runs.png", clicks=(*tidy, 'text="Model training"'))
        camera.shoot(f"{page}/runs/{run.info.run_id}", out / "mlflow-run.png", clicks=tidy)
        camera.shoot(f"{page}/runs/{run.info.run_id}/model-metrics", out / "mlflow-model-metrics.png", clicks=tidy)
        camera.shoot(f"{page}/traces", out / "mlflow-traces.png", clicks=tidy)
        camera.shoot(
            f"{page}/traces?selectedEvaluationId={trace.info.trace_id}",
            out / "mlflow-trace.png",
            clicks=(*tidy, 'text="chat policy"'),
        )
        camera.close()
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        print(f"logs in {work}")


if __name__ == "__main__":
    main()
