"""MLflow tracking for a training run: params, per-iteration metrics, checkpoints as artifacts, registered models.

MLflow is imported on first use, never when `lightning` is imported. Without a tracking URI (argument or
MLFLOW_TRACKING_URI) runs go to a local SQLite store, `.lightning/mlflow.db`, with artifacts in
`.lightning/mlartifacts`: MLflow 3 refuses its old `./mlruns` file store unless MLFLOW_ALLOW_FILE_STORE is set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.credentials import expand, redact
from lightning.environment import MLFLOW_TRACKING_URI

logger = logging.getLogger(__name__)

DEFAULT_DB = Path(".lightning") / "mlflow.db"
DEFAULT_TRACKING_URI = f"sqlite:///{DEFAULT_DB}"
"""TrainConfig.tracking_uri's default, relative to the checkout (what `make mlflow-ui` serves)."""
LOCAL_UI_HOST, LOCAL_UI_PORT = "127.0.0.1", 5000
"""Where `lightning mlflow ui` (and `make mlflow-ui`) serve a local store's UI, unless told otherwise."""
LOCAL_UI = f"http://{LOCAL_UI_HOST}:{LOCAL_UI_PORT}"
ARTIFACTS_DIR = "mlartifacts"
# MLflow's limits (mlflow.utils.validation): longer params are refused, bigger batches split.
MAX_PARAM_KEY = 250
MAX_PARAM_VALUE = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

# A key naming a credential: `api_key`, `password`, `secret` (and kin) anywhere in it, or `token` as its last word. So
# `openai.api_key`, `hf_token` and `db.password` are dropped, while `max_tokens` and `pad_token_id` are logged.
SECRET_KEY = re.compile(
    r"api[_-]?key|apikey|access[_-]?key|private[_-]?key|passw(or)?d|passphrase|secret|credential|authori[sz]ation"
    r"|bearer|(^|[_\-.])(auth|token)$",
    re.IGNORECASE,
)
EXPERIMENT_KIND = "mlflow.experimentKind"
NOTE = "mlflow.note.content"
SOURCE_NAME, SOURCE_TYPE, SOURCE_COMMIT = "mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit"
"""The source tags MLflow's UI shows (its Source field, and the commit beside it)."""
"""The tag MLflow's UI shows as the run's description, rendered as Markdown."""
PREFECT_FLOW_RUN_ID, PREFECT_FLOW_RUN_URL = "prefect.flow_run_id", "prefect.flow_run_url"
"""The run tags that name the Prefect flow run training it (set by the flows)."""
LOCAL_PREFECT_UI = "http://127.0.0.1:4200"
"""Where `make prefect-ui` serves Prefect's UI on the database of `python -m flows.*`'s temporary servers."""
MODEL_TRAINING = "custom_model_development"
"""The experiment kind that MLflow 3's UI opens on runs (params, metrics, charts), not on GenAI's traces pages."""
CONFIG_ARTIFACT = "config.yaml"
LOG10_METRICS = ("mismatch_mean", "mismatch_max")
"""Metrics of about 1e-6 (float32 engines), which MLflow's charts label "0" all the way up their axis: logged also as
their log10 (`mismatch_mean_log10`: -5.5), whose chart reads."""
ERROR_ARTIFACT = "error.txt"
ERROR_TAG_CHARS = 500


class MlflowTracker:
    """One MLflow run: `start(params)` (or `resume(run_id)`), `log_metrics` each iteration, `log_checkpoint`,
    `register_model`, `end(status)`.

    `run_id` names an existing run to continue: `start` then resumes it instead of creating one.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "lightning",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        system_metrics: bool = False,
    ) -> None:
        self.tracking_uri = tracking_uri or os.environ.get(MLFLOW_TRACKING_URI) or _default_tracking_uri()
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.experiment_id: str | None = None
        self.tags = dict(tags or {})
        """Run tags set by `start` (on a resumed run too: the latest process's source commit, flow run, user)."""
        self.system_metrics = system_metrics
        """`start` logs the machine's CPU, memory, disk, network (GPU) use as `system/*` metrics until `end`."""
        self._client: Any = None
        self._monitor: Any = None

    @property
    def client(self) -> Any:
        """The MlflowClient for this tracker's URI (tracking and model registry alike)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            db_path = _sqlite_path(self.tracking_uri)
            if db_path is not None and not db_path.exists():
                db_path.parent.mkdir(parents=True, exist_ok=True)
                new_local_db(db_path)
            uri = self.expanded_uri
            self._client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        return self._client

    @property
    def expanded_uri(self) -> str:
        """The tracking URI with its `${VAR}` references read (for MLflow's own calls; never logged)."""
        return expand(self.tracking_uri)

    def start(self, params: Mapping[str, Any] | None = None) -> str:
        """Create the run (or resume `run_id`), set its tags and log `params`, flattened to dotted keys; the run
        id. The experiment is marked as model training (MLflow 3's UI then opens on its runs)."""
        resumed = self.run_id is not None
        if resumed:
            self.resume(self.run_id)
        else:
            self.experiment_id = self._experiment_id()
            run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id
            self.run_name = run.info.run_name
        self._mark_experiment()
        self._describe()
        if resumed and self.tags:
            from mlflow.entities import RunTag

            self.client.log_batch(self._run(), tags=[RunTag(key, value) for key, value in self.tags.items()])
        if params:
            self._log_params(params)
        if self.system_metrics:
            self._start_system_metrics(resumed)
        return self.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's whole config as the `config.yaml` artifact (secrets dropped, URL passwords masked: as params)."""
        import yaml

        text = yaml.safe_dump(redacted(config), sort_keys=False, allow_unicode=True)
        self.client.log_text(self._run(), text, CONFIG_ARTIFACT)

    def find_run(self) -> str | None:
        """The id of the newest run named `run_name` in the experiment (None: there is none yet)."""
        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is None or self.run_name is None:
            return None
        name = self.run_name.replace("'", "\\'")
        runs = self.client.search_runs(
            [experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )  # fmt: skip
        return runs[0].info.run_id if runs else None

    def logged_steps(self, key: str) -> set[int]:
        """The steps at which metric `key` has been logged in this run."""
        return {metric.step for metric in self.client.get_metric_history(self._run(), key)}

    def resume(self, run_id: str) -> str:
        """Continue run `run_id`: later metrics, artifacts and params land in it; the run id."""
        run = self.client.get_run(run_id)
        self.run_id = run.info.run_id
        self.run_name = run.info.run_name
        self.experiment_id = run.info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log numeric metrics (nested dicts flattened to dotted keys) at `step`; non-finite values are skipped.
        The LOG10_METRICS go in twice, as they are and as `<name>_log10`."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = []
        for key, value in with_log10(flatten(metrics)).items():
            try:
                number = float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"metric {key!r} is not a number: {value!r}") from exc
            if math.isfinite(number):
                batch.append(Metric(key, number, timestamp, step))
            else:
                logger.warning("metric %r at step %d is %s; not logged", key, step, number)
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self._run(), metrics=batch[i : i + METRICS_PER_BATCH])

    def log_checkpoint(self, path: str | Path, step: int, with_trainer_state: bool = False) -> str:
        """Upload checkpoint `path` as artifacts under `checkpoints/step-<step:06d>`; that artifact path.

        The trainer state (optimizer moments: twice the model's size) stays local unless `with_trainer_state`.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {path} is not a directory")
        artifact_path = f"checkpoints/step-{step:06d}"
        for entry in sorted(path.iterdir()):
            if entry.is_file():
                self.client.log_artifact(self._run(), str(entry), artifact_path)
            elif entry.is_dir() and (with_trainer_state or entry.name != "trainer_state"):
                self.client.log_artifacts(self._run(), str(entry), f"{artifact_path}/{entry.name}")
        return artifact_path

    def register_model(
        self, path: str | Path, name: str, tags: Mapping[str, str] | None = None, description: str | None = None
    ) -> int:
        """Register checkpoint `path`'s model directory as a new version of model `name` (created if needed),
        uploading it first unless `log_checkpoint` did; the version number.

        A plain artifact version, no MLmodel flavor: with MLFLOW_TRACKING_URI naming this store,
        `mlflow.artifacts.download_artifacts("models:/<name>/<version>")` returns the Hugging Face directory, which
        transformers and vLLM load as is. A LoRA checkpoint is registered merged into its base (`lightning.export`),
        uploaded under `checkpoints/step-<step>-merged`.
        """
        from mlflow.exceptions import MlflowException

        from lightning.checkpoint import is_adapter_dir

        path = Path(path)
        step = _checkpoint_step(path)
        artifact_path = f"checkpoints/step-{step:06d}"
        if is_adapter_dir(path):
            artifact_path = self._log_merged(path, step)
        elif not self.client.list_artifacts(self._run(), artifact_path):
            self.log_checkpoint(path, step)
        try:
            self.client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = self.client.create_model_version(
            name, f"runs:/{self.run_id}/{artifact_path}", run_id=self.run_id, tags={"step": str(step), **(tags or {})},
            description=description,
        )  # fmt: skip
        return int(version.version)

    def _log_merged(self, adapter_checkpoint: Path, step: int) -> str:
        """Upload the whole model that LoRA checkpoint `step` stands for (its adapter merged into its base) unless
        uploaded already; its artifact path."""
        import tempfile

        from lightning.export import export_model

        artifact_path = f"checkpoints/step-{step:06d}-merged"
        if not self.client.list_artifacts(self._run(), artifact_path):
            with tempfile.TemporaryDirectory(prefix="merged-") as out:
                self.client.log_artifacts(self._run(), str(export_model(adapter_checkpoint, out)), artifact_path)
        return artifact_path

    def promote(self, name: str, version: int | str, alias: str = "champion") -> None:
        """Point registered model `name`'s `alias` at `version` (`models:/<name>@<alias>` then loads it)."""
        self.client.set_registered_model_alias(name, alias, str(version))

    def log_failure(self, message: str) -> None:
        """Why the run failed, where MLflow's UI shows it: the `error` tag (its first line) and `error.txt`."""
        first = message.strip().splitlines()[0] if message.strip() else "(no message)"
        self.client.set_tag(self._run(), "error", first[:ERROR_TAG_CHARS])
        self.client.log_text(self._run(), message, ERROR_ARTIFACT)

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run FINISHED, FAILED or KILLED (system metrics stop first)."""
        if self._monitor is not None:
            monitor, self._monitor = self._monitor, None
            try:
                monitor.finish()
            except Exception:
                logger.warning("stopping MLflow's system metrics failed", exc_info=True)
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status.upper())

    @property
    def run_url(self) -> str:
        """The run's page: on the tracking server, or for a local store where its UI serves it (`ui_command`)."""
        server = redact(self.tracking_uri) if is_server(self.tracking_uri) else LOCAL_UI
        return f"{server.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("no MLflow run: call start() or resume() first")
        return self.run_id

    def _describe(self) -> None:
        """The run's description (MLflow renders it as Markdown, with links; tags are plain text): the Prefect flow
        run that trains it, when a flow does."""
        url = self.tags.get(PREFECT_FLOW_RUN_URL)
        if url:
            flow_run = self.tags.get(PREFECT_FLOW_RUN_ID, "the flow run")
            note = f"Trained by Prefect flow run [{flow_run}]({url})"
            if url.startswith(LOCAL_PREFECT_UI):
                note += f" (`make prefect-ui` serves {LOCAL_PREFECT_UI} for a run of `python -m flows.*`)"
            self.client.set_tag(self._run(), NOTE, note + ".")

    def _mark_experiment(self) -> None:
        """Mark the experiment as model training, unless someone chose its kind already."""
        experiment = self.client.get_experiment(self.experiment_id)
        if EXPERIMENT_KIND not in experiment.tags:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)

    def _start_system_metrics(self, resumed: bool) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self._run(), resume_logging=resumed, tracking_uri=self.expanded_uri)
            self._monitor.start()
        except Exception as exc:  # psutil missing (MLflow says so), or a monitor that cannot start
            logger.warning("MLflow system metrics are off: %s", exc)
            self._monitor = None

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        db_path = _sqlite_path(self.tracking_uri)
        # A local store keeps artifacts beside its database; a server decides for itself.
        location = (db_path.parent / ARTIFACTS_DIR).resolve().as_uri() if db_path is not None else None
        try:
            return self.client.create_experiment(
                self.experiment, artifact_location=location, tags={EXPERIMENT_KIND: MODEL_TRAINING}
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            # Another process created it first.
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    def _log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self._run()).data.params
        batch = []
        for key, value in loggable_params(params).items():
            if key not in logged:
                batch.append(Param(key, value))
            elif logged[key] != value:
                # MLflow params cannot change; a resumed run keeps what it started with.
                logger.warning(
                    "param %r was %r when the run started and is %r now; keeping %r",
                    key,
                    logged[key],
                    value,
                    logged[key],
                )
        for i in range(0, len(batch), PARAMS_PER_BATCH):
            self.client.log_batch(self._run(), params=batch[i : i + PARAMS_PER_BATCH])


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def with_log10(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` and, for each of LOG10_METRICS above 0, its log10 as `<name>_log10`."""
    logs = {}
    for key, value in metrics.items():
        if key.rsplit(".", 1)[-1] in LOG10_METRICS and isinstance(value, int | float) and value > 0:
            logs[f"{key}_log10"] = math.log10(value)
    return {**metrics, **logs}


def loggable_params(params: Mapping[str, Any]) -> dict[str, str]:
    """`params` flattened, secrets dropped, passwords in URLs masked, keys and values cut to MLflow's limits."""
    loggable = {}
    for key, value in flatten(params).items():
        if any(SECRET_KEY.search(part) for part in key.split(".")):
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        text = redact(text)
        if len(text) > MAX_PARAM_VALUE:
            text = text[: MAX_PARAM_VALUE - 3] + "..."
        loggable[key[:MAX_PARAM_KEY]] = text
    return loggable


def redacted(values: Any) -> Any:
    """`values` (nested dicts and lists) with the keys that name a credential dropped and URL passwords masked."""
    if isinstance(values, Mapping):
        return {
            key: redacted(value) for key, value in values.items() if not SECRET_KEY.search(str(key))
        }  # fmt: skip
    if isinstance(values, list | tuple):
        return [redacted(value) for value in values]
    if isinstance(values, str):
        return redact(values)
    return values


def run_tags(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tags MLflow's UI shows for where a run came from: its source (`mlflow.source.name`, the command that
    ran it: `flows.train` for a flow, else the script; with it the UI shows the git commit), the working
    directory's checkout (`mlflow.source.git.commit`, `.branch`, `.repoURL` without credentials), the user
    (`mlflow.user`), and `extra` (the flow run's id and URL, its source name)."""
    import getpass
    import sys

    tags: dict[str, str] = {SOURCE_TYPE: "LOCAL", SOURCE_NAME: Path(sys.argv[0]).name or "python"}
    with contextlib.suppress(Exception):  # no user name in the environment or the password database
        tags["mlflow.user"] = getpass.getuser()
    commit = _git("rev-parse", "HEAD")
    if commit is not None and re.fullmatch(r"[0-9a-f]{40,64}", commit):
        tags[SOURCE_COMMIT] = commit
        branch = _git("rev-parse", "--abbrev-ref", "HEAD")
        if branch and branch != "HEAD":
            tags["mlflow.source.git.branch"] = branch
        remote = _git("remote", "get-url", "origin")
        if remote:
            tags["mlflow.source.git.repoURL"] = re.sub(r"://[^/@\s]*@", "://", remote)  # no user or token
    return {**tags, **(extra or {})}


def _git(*args: str) -> str | None:
    """What `git ARGS` prints in the working directory; None without git or a checkout."""
    import subprocess

    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def is_server(tracking_uri: str) -> bool:
    """A tracking server (its UI is where it answers), rather than a local store (whose UI `ui_command` serves)."""
    return tracking_uri.startswith(("http://", "https://"))


def ui_command(tracking_uri: str) -> str:
    """The command that serves a local store's UI at LOCAL_UI (`make mlflow-ui` for the default store)."""
    if tracking_uri == DEFAULT_TRACKING_URI:
        return "make mlflow-ui"
    return f".venv/bin/lightning mlflow ui --backend-store-uri {redact(tracking_uri)}"


def _default_tracking_uri() -> str:
    return f"sqlite:///{DEFAULT_DB.resolve()}"


def new_local_db(db_path: Path) -> None:
    """A new local tracking database at `db_path`, copied from an empty one of this MLflow version kept in the user's
    cache (made there once, by MLflow itself): MLflow builds a database by running its schema migrations, 2 s of CPU
    for every new run directory otherwise. Its `Default` experiment keeps artifacts beside the database, as the
    run's own experiments do. Nothing is copied where the cache cannot be written: MLflow then builds it. Either way
    the file is its owner's alone (0600), as the store's is: it holds the run's traces (prompts and answers)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    scratch = db_path.with_name(f".{db_path.name}.{os.getpid()}-{threading.get_ident()}")
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning"
        template = cache / f"mlflow-{mlflow.__version__}.db"
        if not template.exists():
            cache.mkdir(parents=True, exist_ok=True)
            building = cache / f".{template.name}.{os.getpid()}-{threading.get_ident()}"
            MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()
            os.replace(building, template)  # whole, or not there: another process may be building it too
        shutil.copyfile(template, scratch)
        scratch.chmod(0o600)
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(scratch)) as db, db:
            db.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                (str((db_path.parent / ARTIFACTS_DIR / "0").resolve()), now, now),
            )
        with contextlib.suppress(FileExistsError):  # another process made it first: that one stays
            os.link(scratch, db_path)
    except (OSError, RuntimeError, sqlite3.Error) as exc:  # no home directory, a damaged copy: MLflow builds it
        logger.debug("no MLflow database template (%s): MLflow builds %s", exc, db_path)
        with contextlib.suppress(FileExistsError):  # in an empty file of the owner's, which SQLite takes as a database
            os.close(os.open(db_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    finally:
        scratch.unlink(missing_ok=True)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///<path>` URI; None for any other URI."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def _checkpoint_step(path: Path) -> int:
    meta = path / "meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["step"])
    match = re.fullmatch(r"step-(\d+)", path.name)
    if match is None:
        raise ValueError(f"{path} has no meta.json and is not named step-<k>: which step is it?")
    return int(match.group(1))
