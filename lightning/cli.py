"""The `lightning` command line: `lightning store serve` runs the store's HTTP server, `lightning proxy
serve` the LLM proxy, `lightning mlflow ui` MLflow's UI."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning import preflight
from lightning.config import TrainConfig, load_config
from lightning.credentials import redact
from lightning.diagnose import collect_stacks, dump_stacks_on_signal
from lightning.environment import (
    BACKEND_API_KEY,
    LITELLM_OFFLINE,
    MLFLOW_TRACKING_URI,
    PROXY_TOKEN,
    STORE_DB,
    STORE_TOKEN,
    STORE_URL,
)
from lightning.errors import ConfigError
from lightning.lifeline import exit_with_parent
from lightning.metrics import DEFAULT_TRACKING_URI, LOCAL_UI_HOST, LOCAL_UI_PORT, MlflowTracker
from lightning.mismatch import compare_spans, format_report, read_spans
from lightning.serving import freeze_startup_objects, is_loopback
from lightning.store import StoreError, open_store
from lightning.store.sql import DEFAULT_URL, SqlLightningStore
from lightning.types import POLICY_MODEL_NAME

TOKEN_ENV, PROXY_TOKEN_ENV, STORE_URL_ENV, BACKEND_KEY_ENV = STORE_TOKEN, PROXY_TOKEN, STORE_URL, BACKEND_API_KEY
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These two have their own argument parsers (also reachable as `python -m lightning.models|inference`).
    if argv[:1] == ["models"] and argv[1:2] != []:
        from lightning.models.__main__ import main as models_main

        models_main(argv[1:])
        return 0
    if argv[:2] == ["inference", "serve"]:
        from lightning.inference.__main__ import main as inference_main

        inference_main(argv[2:])
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int] | None = getattr(args, "run", None)
    if run is None:
        # `lightning` or `lightning store` alone: show what there is to run.
        getattr(args, "help_parser", parser).print_help()
        return 2
    return run(args, args.help_parser)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning", description="lightning: train LLM agents with reinforcement learning."
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    store = _group(
        commands, "store", help="the store of rollouts, attempts, spans and resources",
        description="The store of rollouts, attempts, spans and resources.",
    )  # fmt: skip
    serve = _command(
        store, "serve", _serve, help="serve a store over HTTP (the store protocol and OTLP/HTTP traces)",
        description="Serve a store over HTTP: every store method under /v1/store/, OTLP/HTTP traces at /v1/traces, "
        "GET /health, and the API schema at /docs. Clients use lightning.store.client.HttpLightningStore.",
        epilog=f"The token can also come from ${TOKEN_ENV} (better: a command line is visible to other users of the "
        "machine). Stop the server with Ctrl-C or SIGTERM; the store is closed on the way out.",
    )  # fmt: skip
    _listening(serve, port=4747, token_env=TOKEN_ENV, log_level="info")
    _from_environment(
        serve, "--db", STORE_DB, DEFAULT_URL, metavar="URL",
        help="store database: sqlite:///path.db, or postgresql://user:pass@host:port/db (the variable keeps a "
        "password off the command line)",
    )  # fmt: skip
    serve.add_argument(
        "--watchdog-interval", type=_positive_seconds, default=1.0, metavar="SECONDS",
        help="seconds between the watchdog's passes, which mark attempts past their timeout_seconds or "
        "unresponsive_seconds (default: %(default)s; agent-lightning's server checks on every request: a small value "
        "such as 0.1 comes close, at the cost of a write transaction per pass)",
    )  # fmt: skip
    serve.add_argument(
        "--access-log", action="store_true",
        help="log one line per request (off by default: runners and tracers make thousands a second)",
    )  # fmt: skip

    # These two have their own parsers (also `python -m lightning.models|inference`); `main` hands over to them.
    # Their subcommands are listed here for `--help` only.
    models = _group(
        commands, "models",
        help="local models: `lightning models build-tiny DIR` writes a tiny random-init model and tokenizer",
        description="`lightning models build-tiny DIR [--seed N]`: a tiny Llama and a tokenizer trained on the fly, "
        "as a Hugging Face directory (nothing is downloaded). See `lightning models build-tiny --help`.",
    )  # fmt: skip
    models.add_parser("build-tiny", help="write a tiny random-init model and its tokenizer to DIR", add_help=False)
    inference = _group(
        commands, "inference",
        help="`lightning inference serve --model DIR`: the embedded OpenAI-compatible inference server",
        description="`lightning inference serve --model DIR [--port 8000]`: serve a Hugging Face model directory on "
        "transformers + torch. See `lightning inference serve --help`.",
    )  # fmt: skip
    inference.add_parser("serve", help="serve a Hugging Face model directory over OpenAI's API", add_help=False)

    proxy = _group(
        commands, "proxy", help="the LLM proxy between agents and inference servers",
        description="The LLM proxy: forwards agents' OpenAI calls and stores each, with its token ids, as a span.",
    )  # fmt: skip
    proxy_serve = _command(
        proxy, "serve", _proxy_serve, help="serve the LLM proxy over HTTP",
        description="Serve the LLM proxy: agents call /rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions "
        "(or /completions); the call goes to a backend with return_token_ids on, and its span goes to the store. "
        "Admin: POST /admin/pause, POST /admin/resume, GET /admin/status, PUT /admin/backends.",
        epilog=f"The token can also come from ${PROXY_TOKEN_ENV}. Backends' API keys: --backend-api-key.",
    )  # fmt: skip
    _listening(proxy_serve, port=4748, token_env=PROXY_TOKEN_ENV, log_level="warning")
    _store_option(proxy_serve)
    proxy_serve.add_argument(
        "--backend", action="append", default=[], metavar="URL",
        help="an inference server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (repeat for several)",
    )  # fmt: skip
    proxy_serve.add_argument(
        "--no-token-ids", action="store_true",
        help="the backends do not take vLLM's return_token_ids (spans then hold no token ids)",
    )  # fmt: skip
    _from_environment(proxy_serve, "--backend-api-key", BACKEND_KEY_ENV, None, help="API key the backends require")
    proxy_serve.add_argument(
        "--model-name", default=POLICY_MODEL_NAME,
        help="model name agents ask for, listed on /v1/models; a call for it reaches each backend under the name that "
        "backend serves (the first its GET /v1/models lists) (default: %(default)s)",
    )  # fmt: skip
    proxy_serve.add_argument(
        "--access-log", action="store_true",
        help="log one line per call (off by default: a training run's agents make thousands a minute)",
    )  # fmt: skip
    proxy_serve.add_argument(
        "--external-models", default=None, metavar="FILE",
        help='JSON list of {"model_name": ..., "litellm_params": {...}} answered through LiteLLM',
    )  # fmt: skip
    proxy_serve.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="the policy's model directory (its tokenizer and chat template): a chat call that continues an earlier "
        "call of its attempt is then sent token-exactly (the earlier prompt and response ids, then the new messages'), "
        "so a multi-turn trajectory trains as one row",
    )  # fmt: skip
    proxy_serve.add_argument(
        "--any-agent-key", action="store_true",
        help="serve agents' model calls whatever API key they send (agent-lightning's habit: agents send 'dummy' or "
        "their own OPENAI_API_KEY); the admin routes still need the token. Loopback addresses only",
    )  # fmt: skip

    config = _group(
        commands, "config", help="training run configs: `lightning config defaults` prints every TrainConfig field",
        description="TrainConfig, the configuration of a training run (python -m flows.train CONFIG.yaml).",
    )  # fmt: skip
    _command(config, "defaults", _config_defaults, help="print every field with its default, as YAML")
    check = _command(
        config, "check", _config_check,
        help="validate a config file, then check in seconds what the run needs (data, agent, model, store, keys)",
        description="Validate a TrainConfig file (each bad field named), then check what can be checked in seconds: "
        "the datasets load, the agent imports, the model directory has a config and a tokenizer, the store answers, "
        "the URLs' ${...} secrets and the API keys named are set. One line per problem; exit code 2 if there is any.",
    )  # fmt: skip
    check.add_argument("path", help="a YAML file of TrainConfig fields")

    debug = _group(
        commands, "debug",
        help="diagnose a run: `lightning debug stacks RUN` prints the Python stacks of its processes",
        description="Diagnose a run that is stuck or slow.",
    )  # fmt: skip
    stacks = _command(
        debug, "stacks", _debug_stacks, help="print the Python stacks (all threads) of every live process of a run",
        description="Send SIGUSR1 to every live process of the run (the flow's, the inference server, the LLM proxy, "
        "the trainer); each writes its stacks to <run_dir>/stacks/, which this prints.",
    )  # fmt: skip
    # (dest run_name: `run` is the function each command sets to run it)
    stacks.add_argument("run_name", metavar="RUN", help="the run's name (under --output-dir) or its directory")
    stacks.add_argument("--output-dir", default=".lightning/runs", help="where runs live (default: %(default)s)")
    compare = _command(
        debug, "compare-logprobs", _debug_compare_logprobs,
        help="replay stored rollouts through Transformers and compare each sampled token's log-prob with the engine's",
        description="For each LLM call of the chosen rollouts that the proxy stored with token ids and the "
        "engine's log-probs, recompute every sampled token's log-prob with Hugging Face Transformers (float32) on "
        "MODEL and print the largest differences and a summary. On the checkpoint the rollouts were sampled from, "
        "a float32 engine differs by about 1e-6 and a bfloat16 one by about 1e-2; far more means the engine was not "
        "serving those weights.",
    )  # fmt: skip
    compare.add_argument("model", help="a Hugging Face model directory (e.g. the run's checkpoints/step-000003)")
    _store_option(compare)
    compare.add_argument("--queue", help="only rollouts of this queue (a training run's queue is its name)")
    compare.add_argument("--rollout", action="append", default=[], help="a rollout id (repeatable)")
    compare.add_argument("--limit", type=int, default=8, help="the newest N succeeded rollouts (default: %(default)s)")
    compare.add_argument(
        "--threshold", type=float, default=0.1, help="|delta| counted as a mismatch (default: %(default)s)"
    )
    compare.add_argument(
        "--show", type=int, default=20, help="tokens listed, largest |delta| first (default: %(default)s)"
    )

    export = _command(
        commands, "export", _export,
        help="write a checkpoint as a whole Hugging Face model directory (a LoRA adapter merged into its base)",
        description="Write checkpoint CHECKPOINT (a run's checkpoints/step-NNNNNN) to OUT as a Hugging Face model "
        "directory that transformers and vLLM load as is: a LoRA checkpoint's adapter merged into the base model its "
        "meta names (float32), a whole-weights checkpoint's model files copied; the tokenizer with it, the trainer "
        "state left out. A run with checkpoint.register_model registers its final LoRA checkpoint merged the same way.",
    )  # fmt: skip
    export.add_argument("checkpoint", help="a checkpoint directory, e.g. .lightning/runs/demo/checkpoints/step-000005")
    export.add_argument("out", help="the model directory to write (new, or empty)")

    mlflow = _group(
        commands, "mlflow",
        help="MLflow: `lightning mlflow ui` opens a run store's UI offline; `promote` sets a model version's alias",
        description="MLflow, where runs log params, metrics, checkpoints, agent traces and registered models.",
    )  # fmt: skip
    ui = _command(
        mlflow, "ui", _mlflow_ui, help="serve MLflow's UI on a tracking store (default: the runs' local SQLite store)",
        description="Run `mlflow ui` on a tracking store, with LITELLM_LOCAL_MODEL_COST_MAP=True: MLflow imports "
        "LiteLLM, which otherwise fetches its model price list from the internet first (minutes offline). MLflow's "
        "job runner (seven worker processes for GenAI evaluation jobs, which training runs do not use) stays off "
        "unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true.",
    )  # fmt: skip
    _from_environment(ui, "--backend-store-uri", MLFLOW_TRACKING_URI, DEFAULT_TRACKING_URI, help="the tracking store")
    ui.add_argument("--host", default=LOCAL_UI_HOST, help="(default: %(default)s)")
    ui.add_argument("--port", type=int, default=LOCAL_UI_PORT, help="(default: %(default)s)")
    promote = _command(
        mlflow, "promote", _mlflow_promote, help="point a registered model's alias (default `champion`) at a version",
        description="Point registered model NAME's alias at VERSION: `models:/NAME@champion` then loads it "
        "(mlflow.artifacts.download_artifacts gives the Hugging Face directory). A run registers its final model "
        "when checkpoint.register_model names one, with its held-out reward as the version's `val_reward` tag; "
        "`best` promotes the version with the highest, `latest` the newest (it says so if another one is better).",
    )  # fmt: skip
    promote.add_argument("name", help="the registered model (checkpoint.register_model)")
    promote.add_argument(
        "version", help="the version to promote: a number, `latest` (the newest) or `best` (the highest val_reward)"
    )
    promote.add_argument("--alias", default="champion", help="(default: %(default)s)")
    _from_environment(promote, "--tracking-uri", MLFLOW_TRACKING_URI, DEFAULT_TRACKING_URI, help="the tracking store")
    return parser


def _group(commands: Any, name: str, **texts: str) -> Any:
    """A command of commands (`lightning store`): alone, it prints its help; its subcommands, returned, attach to it."""
    parser = commands.add_parser(name, **texts)
    parser.set_defaults(help_parser=parser)
    return parser.add_subparsers(title="commands", metavar="COMMAND")


def _command(commands: Any, name: str, run: Callable[..., int], **texts: str) -> argparse.ArgumentParser:
    """A command that runs `run(args, its parser)`."""
    parser = commands.add_parser(name, **texts)
    parser.set_defaults(run=run, help_parser=parser)
    return parser


def _listening(parser: argparse.ArgumentParser, *, port: int, token_env: str, log_level: str) -> None:
    """How a server command listens: --host, --port, --token (from `token_env` by default), --log-level, and
    --max-body-mb."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=port, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--token", default=None,
        help=f"require 'Authorization: Bearer TOKEN' on every request (default: ${token_env}, else none); "
        "required when --host is not a loopback address",
    )  # fmt: skip
    parser.add_argument("--log-level", default=log_level, choices=LOG_LEVELS, help="(default: %(default)s)")
    parser.add_argument(
        "--max-body-mb", type=float, default=32, help="answer 413 to a request body larger than this (default: 32)"
    )


def _from_environment(
    parser: argparse.ArgumentParser, flag: str, env: str, default: str | None, *, help: str, **options: Any
) -> None:
    """An option whose default is the variable `env`, else `default`."""
    otherwise = f", else {default}" if default is not None else ""
    parser.add_argument(
        flag, default=os.environ.get(env, default), help=f"{help} (default: ${env}{otherwise})", **options
    )


def _store_option(parser: argparse.ArgumentParser) -> None:
    _from_environment(
        parser, "--store", STORE_URL_ENV, DEFAULT_URL, metavar="URL",
        help="store database or store server URL (the variable keeps a password off the command line)",
    )  # fmt: skip


def _mlflow_ui(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    mlflow = Path(sys.executable).parent / "mlflow"
    command = [str(mlflow) if mlflow.is_file() else "mlflow", "ui", "--backend-store-uri", args.backend_store_uri]
    command += ["--host", args.host, "--port", str(args.port)]
    where = redact(args.backend_store_uri)
    print(f"MLflow UI on http://{args.host}:{args.port} ({where}); Ctrl-C stops it", flush=True)
    os.environ[LITELLM_OFFLINE] = "True"
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execvp(command[0], command)
    return 0  # not reached


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning.checkpoint import CheckpointError, is_adapter_dir
    from lightning.export import export_model

    try:
        out = export_model(args.checkpoint, args.out)
    except (CheckpointError, FileExistsError) as exc:
        parser.error(str(exc))
    how = "its LoRA adapter merged into its base" if is_adapter_dir(args.checkpoint) else "its whole weights"
    print(f"wrote {out}: {args.checkpoint}, {how}")
    return 0


def _mlflow_promote(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    tracker = MlflowTracker(args.tracking_uri)
    versions = tracker.client.search_model_versions(f"name = '{args.name}'")
    if not versions:
        parser.error(f"no registered model {args.name!r} at {redact(args.tracking_uri)}")
    newest = max(versions, key=lambda v: int(v.version))
    rewarded = [v for v in versions if _reward(v) is not None]
    best = max(rewarded, key=lambda v: (_reward(v), int(v.version))) if rewarded else None
    if args.version == "best" and best is None:
        parser.error(f"no version of {args.name!r} has a val_reward tag: give a version number, or `latest`")
    chosen = {"latest": newest, "best": best}.get(args.version)
    version = str(chosen.version) if chosen is not None else args.version
    tracker.promote(args.name, version, args.alias)
    reward = tracker.client.get_model_version(args.name, version).tags.get("val_reward", "?")
    print(f"models:/{args.name}@{args.alias} -> version {version} (held-out reward {reward})")
    promoted = _reward_of(reward)
    if best is not None and str(best.version) != version and (promoted is None or _reward(best) > promoted):
        print(
            f"note: version {best.version} has a higher held-out reward ({best.tags['val_reward']}); "
            f"`lightning mlflow promote {args.name} best` promotes it"
        )
    return 0


def _reward(version: object) -> float | None:
    return _reward_of(getattr(version, "tags", {}).get("val_reward"))


def _reward_of(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _debug_compare_logprobs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"model: {args.model} is not a Hugging Face model directory (no config.json)")
    where = redact(args.store)
    database = _sqlite_file(args.store)
    if database is not None and not database.is_file():  # (opening it would make an empty store there)
        print(f"error: --store {where}: no such file {database}; give the run's store_url", file=sys.stderr)
        return 1

    async def read() -> dict[str, list[Any]]:
        store = open_store(args.store, watchdog_interval=None)
        try:
            ids = list(args.rollout)
            if not ids:
                newest = await store.query_rollouts(
                    queue=args.queue, status_in=["succeeded"], sort_by="end_time", sort_order="desc", limit=args.limit
                )
                ids = [rollout.rollout_id for rollout in reversed(newest.items)]
                if not ids:
                    scope = f"queue {args.queue!r} of " if args.queue else ""
                    parser.error(f"no succeeded rollouts in {scope}the store {where}")
            return await read_spans(store, ids)
        finally:
            await store.close()

    # The store first, the model after: an unknown rollout or a store that does not answer is one line, in seconds.
    client_log = logging.getLogger("lightning.store.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)  # its "failed after 4 tries" would repeat the error line below
    try:
        spans = asyncio.run(read())
    except StoreError as exc:  # an unknown rollout id, a store server that does not answer
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a database that cannot be opened (PostgreSQL down, a wrong password): not a traceback
        first = next((line.strip() for line in redact(str(exc)).splitlines() if line.strip()), "")
        print(f"error: --store {where}: cannot read the store: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    finally:
        client_log.setLevel(level)
    print(format_report(compare_spans(spans, args.model), args.threshold, args.show))
    return 0


def _sqlite_file(url: str) -> Path | None:
    """The file a `sqlite:///` store URL names; None for any other store (or SQLite in memory)."""
    if url.partition("://")[0].split("+", 1)[0] != "sqlite":
        return None
    database = url.partition("://")[2].removeprefix("/").split("?", 1)[0]
    return Path(database) if database not in ("", ":memory:") else None


def _debug_stacks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    run_dir = Path(args.run_name) if Path(args.run_name).is_dir() else Path(args.output_dir) / args.run_name
    if not run_dir.is_dir():
        parser.error(f"no run {args.run_name!r}: neither a directory nor a run under --output-dir {args.output_dir}")
    print(collect_stacks(run_dir / "stacks"))
    return 0


def _config_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(yaml.safe_dump(TrainConfig().model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _config_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Agents and datasets named as module:function are imported as `python -m flows.train` would: from here.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        config = load_config(args.path)
        preflight.check(config, optimiser=config.apo is not None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.path}: a valid TrainConfig, ready to run (run {config.run_name!r}, {config.iterations} iterations)")
    return 0


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"give a number of seconds above 0, not {text}")
    return seconds


def _token_or_refuse(args: argparse.Namespace, parser: argparse.ArgumentParser, env: str, exposure: str) -> str | None:
    """The server's bearer token (--token, else $env); without one, only a loopback address is allowed."""
    token = args.token or os.environ.get(env) or None
    if token is None and not is_loopback(args.host):
        parser.error(
            f"refusing to serve on {args.host} without a token: anyone who can reach it could {exposure}. "
            f"Pass --token (or set ${env}), or listen on 127.0.0.1."
        )
    return token


def _proxy_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from lightning.proxy import Backend, ExternalModel, LLMProxy

    exit_with_parent()  # started by a run: it dies with the run
    dump_stacks_on_signal(None, "llm-proxy")  # into the run's stacks directory, when a run started it
    token = _token_or_refuse(args, parser, PROXY_TOKEN_ENV, "use the models and write spans")
    external: list[ExternalModel] = []
    if args.external_models:
        try:
            external = [ExternalModel.model_validate(m) for m in json.loads(Path(args.external_models).read_text())]
        except (OSError, ValueError) as exc:
            parser.error(f"--external-models {args.external_models}: {exc}")
    if not args.backend and not external:
        parser.error("give at least one --backend URL (or --external-models)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = open_store(args.store, watchdog_interval=None)
    backends = [Backend(url=url, token_ids=not args.no_token_ids, api_key=args.backend_api_key) for url in args.backend]
    if args.any_agent_key and not is_loopback(args.host):
        parser.error(f"--any-agent-key: only on a loopback address; on {args.host} agents must send the token")
    proxy = LLMProxy(
        store,
        backends,
        model_name=args.model_name,
        external_models=external,
        token=token,
        agents_need_token=not args.any_agent_key,
        tokenizer=args.tokenizer,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )
    proxy.url = f"http://{args.host}:{args.port}"
    try:
        auth = "bearer token required" if token else "no token"
        print(
            f"lightning proxy: {proxy.url} -> {args.backend}, spans to {store!r} ({auth})", file=sys.stderr, flush=True
        )
        # uvicorn logs its access lines at info: asking for them lowers a quieter --log-level to info.
        level = "info" if args.access_log and args.log_level in ("warning", "error", "critical") else args.log_level
        freeze_startup_objects()
        uvicorn.run(proxy.app, host=args.host, port=args.port, log_level=level, access_log=args.access_log)
    finally:
        asyncio.run(store.close())
    return 0


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from lightning.store.server import create_app

    token = _token_or_refuse(args, parser, TOKEN_ENV, "read and change the store")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The server's loop does nothing but serve the store: SQLite transactions run on it, not handed to a thread.
    store = SqlLightningStore(args.db, threaded=False, watchdog_interval=args.watchdog_interval)
    try:
        auth = "bearer token required" if token else "no token"
        print(f"lightning store: {store!r} on http://{args.host}:{args.port} ({auth})", file=sys.stderr, flush=True)
        app = create_app(store, token=token, max_body_bytes=int(args.max_body_mb * 1024 * 1024))
        freeze_startup_objects()
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    finally:
        asyncio.run(store.close())
    return 0


__path__: list[str] = []
"""A package for agent-lightning's paths below `agentlightning.cli` (lightning.cli.store, ...), which
lightning.agl_import_paths answers for (its command line is ours: `lightning store serve`, ...)."""


if __name__ == "__main__":
    raise SystemExit(main())
