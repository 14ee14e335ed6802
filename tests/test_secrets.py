"""No secret in the clear: a store URL whose password is a `${VAR}` reference trains for real (PostgreSQL), and the
password (and the run's proxy token, from $LIGHTNING_PROXY_TOKEN) is then nowhere: not in Prefect's database, not on
any process's command line, not in any log, not in MLflow, not in the store's spans or resources, not in the run's
files. The same holds for a store server's token and an endpoint's API key given by reference, trained through for
real beside a planted proxy token. And every printed URL, MLflow's params among them, masks its credentials."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from prefect_server import PrefectServer, start_logged, stop_process_group, tail

from lightning.metrics import loggable_params

pytest_plugins = ["prefect_server"]


def test_params_drop_secret_keys_and_mask_url_passwords() -> None:
    params = loggable_params(
        {
            "store_url": "postgresql://user:hunter2@db:5432/x",
            "tracking_uri": "http://:tok3n@mlflow:5000",
            "proxy": {"auth": "a", "bearer": "b", "access_key": "c", "passphrase": "d", "hf_token": "e"},
            "sampling": {"max_tokens": 4},
            "pad_token_id": 0,
        }
    )
    assert params["store_url"] == "postgresql://user:***@db:5432/x"
    assert params["tracking_uri"] == "http://:***@mlflow:5000"
    assert not any(key.startswith("proxy.") for key in params), params
    assert params["sampling.max_tokens"] == "4" and params["pad_token_id"] == "0"


@pytest.mark.slow
def test_runs_open_at_once_in_one_process_share_one_proxy_token_and_the_last_takes_it_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A train and a dev run in one process (same store, same name) each chose a token and then both put theirs in
    the environment: the first run's runners signed with the second's token and its proxy answered 401."""
    from lightning.credentials import claim_proxy_token

    monkeypatch.delenv("LIGHTNING_PROXY_TOKEN", raising=False)
    (first, release_first), (second, release_second) = claim_proxy_token(), claim_proxy_token()
    assert first == second == os.environ["LIGHTNING_PROXY_TOKEN"]
    release_first()
    assert os.environ["LIGHTNING_PROXY_TOKEN"] == second  # the second run still signs with it
    release_second()
    assert "LIGHTNING_PROXY_TOKEN" not in os.environ
    monkeypatch.setenv("LIGHTNING_PROXY_TOKEN", "users-own")  # a token the user set is used, and stays
    token, release = claim_proxy_token()
    release()
    assert token == os.environ["LIGHTNING_PROXY_TOKEN"] == "users-own"


def test_a_prefect_secret_block_named_in_a_url_reaches_the_connection_not_the_config(
    prefect_server: PrefectServer,
) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.secret_blocks import export_secret_blocks
    from lightning.config import load_config
    from lightning.credentials import expand, secret_env_name

    value = f"pw-{secrets.token_hex(6)}"
    variable = secret_env_name("db-password")
    os.environ.pop(variable, None)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            Secret(value=value).save("db-password", overwrite=True)
            config = load_config({"store_url": "postgresql://trainer:${secret:db-password}@db:5432/lightning"})
            assert asyncio.run(export_secret_blocks(config)) == ["db-password"]
        assert variable == "LIGHTNING_SECRET_DB_PASSWORD"
        assert expand(config.store_url) == f"postgresql://trainer:{value}@db:5432/lightning"
        assert value not in config.model_dump_json()
    finally:
        os.environ.pop(variable, None)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_password_named_by_reference_is_used_and_never_shown(
    prefect_server: PrefectServer, pg_schema_url: str, tmp_path: Path
) -> None:
    password = f"pw-{secrets.token_hex(8)}"
    scheme, rest = pg_schema_url.split("://", 1)
    user_host = rest.replace("@", ":${LIGHTNING_TEST_DB_PASSWORD}@", 1) if "@" in rest else rest
    store_url = f"{scheme}://{user_host}"  # trust auth: the password is sent, and accepted
    config = {
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "run_name": "secretive", "iterations": 1, "batch_size": 4, "samples_per_task": 2, "n_runners": 1,
        "runner_concurrency": 8, "val_data": None, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "max_prompt_length": 64, "max_response_length": 4, "algorithm": {"lr": 1e-3, "micro_batch_size": 16},
        "store_url": store_url, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    proxy_token = f"proxy-{secrets.token_hex(8)}"  # the run's LLM proxy's bearer token, as a user sets it
    env = {**prefect_server.env, "LIGHTNING_TEST_DB_PASSWORD": password, "LIGHTNING_PROXY_TOKEN": proxy_token}
    log = tmp_path / "train.log"
    process = start_logged([sys.executable, "-m", "flows.train", str(config_path)], log, env=env, cwd=tmp_path)
    command_lines: set[str] = set()
    try:
        while process.poll() is None:  # every command line of every process, while the run runs
            for other in psutil.process_iter(["cmdline"]):
                command_lines.add(" ".join(other.info["cmdline"] or []))
            time.sleep(0.2)
    finally:
        stop_process_group(process)
    assert process.returncode == 0, tail(log)
    assert "Held-out reward" in log.read_text() or "reward_after" in log.read_text(), tail(log)

    where = {"command lines": "\n".join(command_lines)}
    for path in [log, *tmp_path.rglob("*"), *Path(prefect_server.env["PREFECT_HOME"]).rglob("*")]:
        if path.is_file():
            where[str(path)] = path.read_bytes().decode(errors="replace")
    where["the store"] = _dump_schema(pg_schema_url)
    leaks = {secret: [name for name, text in where.items() if value in text] for secret, value in
             (("the password", password), ("the proxy token", proxy_token))}  # fmt: skip
    assert leaks == {"the password": [], "the proxy token": []}, f"secrets found: {leaks}"
    assert "secretive/train/0/" in where["the store"]  # the run used that store


def _dump_schema(url: str) -> str:
    """Every row of every table of the store's schema, as text (spans, resources, rollouts...)."""
    import psycopg

    plain = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        tables = [row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")]
        assert {"rollouts", "spans", "resources"} <= set(tables), tables
        return "\n".join(str(row) for table in tables for row in conn.execute(f'SELECT * FROM "{table}"'))


async def test_a_store_token_in_the_url_authenticates_and_is_never_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store_url: http://:${VAR}@host:port` (the documented form) authenticates with the variable's token, and an
    error from the server names the server without the token."""
    from support.servers import serving

    from lightning.store import AuthError, SqlLightningStore, open_store
    from lightning.store.server import create_app

    token = "tok-" + secrets.token_hex(8)
    monkeypatch.setenv("STORE_TOK", token)
    monkeypatch.delenv("LIGHTNING_STORE_TOKEN", raising=False)
    backing = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    try:
        with serving(create_app(backing, token=token)) as url:
            # Both documented forms: the URL's user info, and agent-lightning's first part of the path.
            for address in (url.replace("http://", "http://:${STORE_TOK}@"), f"{url}/t/${{STORE_TOK}}"):
                client = open_store(address)
                try:
                    await client.enqueue_rollout({"x": 1})
                    assert token not in repr(client) and token not in client.base_url
                finally:
                    await client.close()
            refusals = []
            for address in (url.replace("http://", "http://:not-the-token@"), f"{url}/t/not-the-token"):
                wrong = open_store(address)
                try:
                    with pytest.raises(AuthError) as refused:
                        await wrong.enqueue_rollout({"x": 2})
                    refusals.append(str(refused.value))
                finally:
                    await wrong.close()
        for refusal in refusals:
            assert "not-the-token" not in refusal and f"the store server at {url} refused" in refusal, refusal
        assert len(await backing.query_rollouts()) == 2
    finally:
        await backing.close()


def test_urls_are_printed_with_their_credentials_masked() -> None:
    from lightning.credentials import redact

    assert redact("the store server at http://:tok-SECRET123-st2@127.0.0.1:47481 refused") == (
        "the store server at http://:***@127.0.0.1:47481 refused"
    )
    assert redact("postgresql://trainer:hunter2@db/x, http://tok@h:1 and http://h:4747/t/tok/v1") == (
        "postgresql://trainer:***@db/x, http://***@h:1 and http://h:4747/t/***/v1"
    )
    # A reference is no secret, a user name alone is one only where it is a store server's token (http).
    kept = "postgresql://trainer:${PGPASSWORD}@db/x postgresql://postgres@db/x http://h:1/t/${TOK} sqlite:///a@b.db"
    assert redact(kept) == kept


def test_a_store_token_given_to_the_agl_trainer_reaches_the_run_by_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Trainer(store=...)` puts the store's URL in the run's config, which Prefect keeps and MLflow shows: a token
    that came with it goes to the run's processes through the environment instead."""
    from lightning import Trainer
    from lightning.store.client import HttpLightningStore

    monkeypatch.delenv("LIGHTNING_STORE_TOKEN", raising=False)
    trainer = Trainer(store="http://:tok-1@127.0.0.1:9")
    assert trainer.build_config(lambda task: 0.0, [{"x": 1}]).store_url == "http://127.0.0.1:9"
    assert os.environ["LIGHTNING_STORE_TOKEN"] == "tok-1"
    Trainer(store=HttpLightningStore("http://127.0.0.1:9/t/tok-2"))
    assert os.environ["LIGHTNING_STORE_TOKEN"] == "tok-2"
    by_reference = Trainer(store="http://:${STORE_TOK}@127.0.0.1:9")  # expanded where the store is opened
    assert by_reference.build_config(lambda task: 0.0, [{"x": 1}]).store_url == "http://:${STORE_TOK}@127.0.0.1:9"


@pytest.mark.slow
def test_a_store_token_and_an_api_key_by_reference_are_used_and_never_shown(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """The other secrets a run holds, each planted where a user puts it: the store server's token in the store URL
    (`http://:${VAR}@host:port`), an inference endpoint's API key (`inference.api_key_env`) and the run's proxy
    token ($LIGHTNING_PROXY_TOKEN). A `train` run's rollouts go through all three (the endpoint, the store server and
    the run's proxy refuse calls without theirs), then none is in its output, a log, a file of the run, MLflow's
    database, the store's, a command line or Prefect's database (each read as bytes), nor is a route signed with the
    proxy token; the databases are their owner's alone."""
    import sqlite3

    from support.servers import free_port
    from support.store_server import store_server_on

    from lightning.environment import INFERENCE_API_KEY
    from lightning.models import build_tiny_model
    from lightning.types import POLICY_MODEL_NAME, route_signature

    store_token, api_key, proxy_token = (f"{kind}-{secrets.token_hex(8)}" for kind in ("store", "key", "proxy"))
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    serve = [sys.executable, "-m", "lightning.inference", "--model", str(model), "--port", str(port),
             "--served-model-name", POLICY_MODEL_NAME]  # fmt: skip
    inference = start_logged(serve, tmp_path / "inference.log", env={**os.environ, INFERENCE_API_KEY: api_key})
    config = {
        "agent": "examples.copy_task.agent:copy_agent", "train_data": "examples.copy_task.data:train_tasks",
        "run_name": "secretive", "iterations": 1, "batch_size": 4,
        "samples_per_task": 2, "n_runners": 1, "runner_concurrency": 8, "val_data": None,
        "sampling": {"temperature": 1.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "micro_batch_size": 16},
        "inference": {"backend": "external", "endpoint": f"http://127.0.0.1:{port}/v1", "api_key_env": "MY_API_KEY"},
        "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    env = {**prefect_server.env, "STORE_TOK": store_token, "MY_API_KEY": api_key, "LIGHTNING_PROXY_TOKEN": proxy_token}
    env.pop("LIGHTNING_STORE_TOKEN", None)
    command_lines: set[str] = set()
    try:
        with store_server_on(f"sqlite:///{tmp_path / 'store.db'}", store_token, tmp_path / "store.log") as store:
            config["store_url"] = store.url.replace("http://", "http://:${STORE_TOK}@")
            config_path = tmp_path / "config.yaml"
            config_path.write_text(yaml.safe_dump(config))
            log = tmp_path / "train.log"  # the command's stdout and stderr
            process = start_logged([sys.executable, "-m", "flows.train", str(config_path)], log, env=env, cwd=tmp_path)
            try:
                while process.poll() is None:
                    for other in psutil.process_iter(["cmdline"]):
                        command_lines.add(" ".join(other.info["cmdline"] or []))
                    time.sleep(0.2)
            finally:
                stop_process_group(process)
    finally:
        stop_process_group(inference)
    assert process.returncode == 0, tail(log)
    assert "rollouts 8 ok, 0 failed" in log.read_text(), tail(log)

    where = {"command lines": "\n".join(command_lines).encode()}
    for path in [*tmp_path.rglob("*"), *Path(prefect_server.env["PREFECT_HOME"]).rglob("*")]:
        if path.is_file():
            where[str(path)] = path.read_bytes()
    for database in ("store.db", "mlflow.db"):  # the run used them, and they are their owner's alone
        assert b"secretive" in where[str(tmp_path / database)], database
        assert stat.S_IMODE((tmp_path / database).stat().st_mode) == 0o600, database
    with contextlib.closing(sqlite3.connect(tmp_path / "store.db")) as db:
        attempts = db.execute("SELECT rollout_id, attempt_id FROM attempts").fetchall()
    assert len(attempts) == 8
    planted = {"the store token": store_token, "the API key": api_key, "the proxy token": proxy_token}
    planted |= {f"the route of {a}": route_signature(proxy_token, r, a) for r, a in attempts}
    leaks = {secret: [name for name, data in where.items() if value.encode() in data] for secret, value in
             planted.items()}  # fmt: skip
    assert leaks == dict.fromkeys(planted, []), f"secrets found: {leaks}"
