"""The vLLM launcher: the commands and environments it builds, its process handling against a stand-in `vllm`
executable (tests/support/fake_vllm.py, real processes and real HTTP), and, where a GPU exists, against real vLLM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from lightning.inference.vllm import (
    VllmConfig,
    VllmError,
    VllmRequestError,
    VllmServer,
    build_vllm_command,
    build_vllm_env,
    max_lora_rank_for,
    publish_lora_adapter,
)
from lightning.serving import free_port

FAKE_VLLM = Path(__file__).parent / "support" / "fake_vllm.py"

# -- commands and environments --------------------------------------------------------------------------------------


def test_minimal_command_serves_the_model_on_loopback() -> None:
    config = VllmConfig(model="/models/tiny", port=8123)
    assert build_vllm_command(config) == ["vllm", "serve", "/models/tiny", "--host", "127.0.0.1", "--port", "8123"]


def test_every_field_becomes_its_flag() -> None:
    config = VllmConfig(
        model="/models/tiny",
        served_model_name="policy",
        port=9000,
        gpu_memory_utilization=0.45,
        max_model_len=4096,
        dtype="bfloat16",
        seed=7,
        tensor_parallel_size=2,
        enable_sleep_mode=True,
        enable_lora=True,
        max_lora_rank=32,
        max_loras=2,
        enable_prefix_caching=True,
        extra_args=["--enforce-eager", "--max-num-seqs", "64"],
    )
    assert build_vllm_command(config) == [
        "vllm", "serve", "/models/tiny", "--host", "127.0.0.1", "--port", "9000",
        "--served-model-name", "policy",
        "--gpu-memory-utilization", "0.45",
        "--max-model-len", "4096",
        "--dtype", "bfloat16",
        "--seed", "7",
        "--tensor-parallel-size", "2",
        "--enable-sleep-mode",
        "--enable-lora", "--max-lora-rank", "32", "--max-loras", "2",
        "--enable-prefix-caching",
        "--enforce-eager", "--max-num-seqs", "64",
    ]  # fmt: skip


def test_a_lora_rank_gets_the_smallest_max_lora_rank_vllm_takes() -> None:
    assert [max_lora_rank_for(rank) for rank in (1, 4, 8, 16, 17, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="rank 512 at most"):
        max_lora_rank_for(513)


def test_prefix_caching_and_tensor_parallel_defaults_add_no_flag() -> None:
    default = build_vllm_command(VllmConfig(model="m"))
    assert not [arg for arg in default if "prefix-caching" in arg or "tensor-parallel" in arg]
    assert build_vllm_command(VllmConfig(model="m", enable_prefix_caching=False))[-1] == "--no-enable-prefix-caching"


def test_sleep_mode_and_weight_reload_turn_on_dev_mode() -> None:
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert (
        build_vllm_env(VllmConfig(model="m", enable_sleep_mode=True, enable_weight_reload=False), base)[
            "VLLM_SERVER_DEV_MODE"
        ]
        == "1"
    )
    assert build_vllm_env(VllmConfig(model="m"), base)["VLLM_SERVER_DEV_MODE"] == "1"
    plain = build_vllm_env(VllmConfig(model="m", enable_weight_reload=False), base)
    # Only the keep-alive beyond the pause between rollout phases (the proxy's pooled connections), and the caller's
    # own value of it wins.
    assert plain == {**base, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300"}
    assert (
        build_vllm_env(VllmConfig(model="m"), {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "9"})["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]
        == "9"
    )
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain


def test_lora_allows_runtime_adapter_updates_and_config_env_is_passed() -> None:
    config = VllmConfig(model="m", enable_lora=True, env={"CUDA_VISIBLE_DEVICES": "3"})
    env = build_vllm_env(config, {"CUDA_VISIBLE_DEVICES": "0", "HOME": "/root"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["HOME"] == "/root"


def test_api_key_goes_to_the_environment_never_to_the_command_or_repr() -> None:
    config = VllmConfig(model="m", api_key="s3cret-key")
    assert "s3cret-key" not in " ".join(build_vllm_command(config))
    assert "s3cret-key" not in repr(config)
    assert "s3cret-key" not in str(config.model_dump())
    assert build_vllm_env(config, {})["VLLM_API_KEY"] == "s3cret-key"
    # A key inherited from the caller would make the server refuse our own keyless calls.
    assert "VLLM_API_KEY" not in build_vllm_env(VllmConfig(model="m"), {"VLLM_API_KEY": "other"})


def test_api_key_in_extra_args_is_refused() -> None:
    with pytest.raises(ValueError, match="extra_args"):
        build_vllm_command(VllmConfig(model="m", extra_args=["--api-key", "k"]))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "gpu-node-7"])
def test_exposed_host_without_api_key_is_refused(host: str) -> None:
    config = VllmConfig(model="m", host=host, enable_weight_reload=False)
    with pytest.raises(ValueError, match="api_key"):
        build_vllm_command(config)
    with pytest.raises(ValueError, match="api_key"):
        build_vllm_env(config, {})
    with pytest.raises(ValueError, match="api_key"):
        VllmServer(config)


def test_exposed_host_with_dev_routes_needs_explicit_consent() -> None:
    config = VllmConfig(model="m", host="0.0.0.0", api_key="k", enable_sleep_mode=True)
    with pytest.raises(ValueError, match="allow_exposed_dev_routes"):
        build_vllm_command(config)
    allowed = config.model_copy(update={"allow_exposed_dev_routes": True})
    assert build_vllm_command(allowed)[3:5] == ["--host", "0.0.0.0"]
    no_dev = VllmConfig(model="m", host="0.0.0.0", api_key="k", enable_weight_reload=False)
    assert "--host" in build_vllm_command(no_dev)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    assert build_vllm_command(VllmConfig(model="m", host=host))[4] == host


def test_urls() -> None:
    server = VllmServer(VllmConfig(model="m", port=8011))
    assert server.base_url == "http://127.0.0.1:8011"
    assert server.endpoint == "http://127.0.0.1:8011/v1"
    assert VllmServer(VllmConfig(model="m", host="::1", port=8011)).base_url == "http://[::1]:8011"


# -- real processes against the stand-in executable ------------------------------------------------------------------


class FakeVllm:
    """Builds configs that launch tests/support/fake_vllm.py, and reads the calls it recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.calls_path = tmp_path / "calls.jsonl"
        self.executable = tmp_path / "vllm"
        self.executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
        self.executable.chmod(self.executable.stat().st_mode | stat.S_IXUSR)

    def config(self, **overrides: Any) -> VllmConfig:
        env = {"FAKE_VLLM_CALLS": str(self.calls_path), **overrides.pop("env", {})}
        fields: dict[str, Any] = {
            "model": str(self.tmp_path / "model"),
            "served_model_name": "policy",
            "port": free_port(),
            "executable": str(self.executable),
            "startup_timeout": 10,
            "stop_timeout": 5,
            "request_timeout": 5,
            "env": env,
        }
        return VllmConfig(**{**fields, **overrides})

    def calls(self) -> list[dict[str, Any]]:
        if not self.calls_path.exists():
            return []
        return [json.loads(line) for line in self.calls_path.read_text().splitlines()]

    def starts(self) -> list[dict[str, Any]]:
        return [call for call in self.calls() if call.get("event") == "start"]

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        admin = [call for call in self.calls() if "path" in call and call["path"] not in ("/health", "/v1/models")]
        return [call for call in admin if path is None or call["path"] == path]


@pytest.fixture
def fake(tmp_path: Path) -> FakeVllm:
    return FakeVllm(tmp_path)


def _is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # an unreaped zombie no longer runs
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _make_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_lifecycle_sleep_reload_lora_swap_and_stop(fake: FakeVllm, tmp_path: Path) -> None:
    config = fake.config(enable_sleep_mode=True, enable_lora=True, max_lora_rank=8)
    step1 = _make_dir(tmp_path / "ckpt-1")
    adapter_a, adapter_b = _make_dir(tmp_path / "lora-a"), _make_dir(tmp_path / "lora-b")

    with VllmServer(config, log_path=tmp_path / "logs" / "vllm.log") as server:
        [start] = fake.starts()
        assert start["argv"] == build_vllm_command(config)[1:]
        assert start["env"] == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        assert httpx.get(f"{server.endpoint}/models").json()["data"][0]["id"] == "policy"
        assert server.weight_version is None

        server.sleep(level=1)
        assert server.is_sleeping()
        server.wake_up(tags=["weights"])
        server.wake_up()
        assert not server.is_sleeping()

        server.reload_weights(step1, version="step-1")
        assert server.weight_version == "step-1"

        server.load_lora_adapter("policy-lora", adapter_a, version="lora-1")
        server.load_lora_adapter("policy-lora", adapter_b)
        assert server.weight_version == str(adapter_b)
        assert server.lora_adapters == {"policy-lora": adapter_b}

        calls = [(c["method"], c["path"], c["query"], c["body"]) for c in fake.requests()]
        assert calls == [
            ("POST", "/sleep", {"level": ["1"]}, None),
            ("GET", "/is_sleeping", {}, None),
            ("POST", "/wake_up", {"tags": ["weights"]}, None),
            ("POST", "/wake_up", {}, None),
            ("GET", "/is_sleeping", {}, None),
            ("POST", "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": str(step1)}}),
            ("POST", "/reset_prefix_cache", {}, None),
            ("POST", "/v1/load_lora_adapter", {}, {"lora_name": "policy-lora", "lora_path": str(adapter_a)}),
            ("POST", "/v1/unload_lora_adapter", {}, {"lora_name": "policy-lora"}),
            ("POST", "/v1/load_lora_adapter", {}, {"lora_name": "policy-lora", "lora_path": str(adapter_b)}),
        ]
        leader = server.process.pid  # type: ignore[union-attr]

    assert server.process is None
    assert _is_gone(leader)
    assert _wait_until(lambda: _is_gone(start["engine_pid"])), "the engine child outlived stop()"
    assert "fake vllm serving policy" in (tmp_path / "logs" / "vllm.log").read_text()


def test_publishing_an_adapter_loads_it_on_every_replica_routes_to_it_then_unloads_the_old_one(
    fake: FakeVllm, tmp_path: Path
) -> None:
    """`publish_lora_adapter`, as a LoRA run's checkpoint calls it on its replicas: each adapter under a new name,
    loaded everywhere before the proxy is told (`route`), the one before unloaded after; a step published again (a
    retried checkpoint, its new adapter at the same path) gets a name of its own, so vLLM's prefix cache cannot mix
    the two."""
    (tmp_path / "b").mkdir()
    other = FakeVllm(tmp_path / "b")
    step1, step2 = _make_dir(tmp_path / "step-1"), _make_dir(tmp_path / "step-2")
    fakes = (fake, other)
    routed = []

    def adapter_calls(each: FakeVllm) -> list[tuple[str, str]]:
        return [(c["path"].removeprefix("/v1/").split("_")[0], c["body"]["lora_name"]) for c in each.requests()]

    def route(name: str) -> None:  # what each replica had been asked when the proxy was told
        routed.append((name, [adapter_calls(each) for each in fakes]))

    with VllmServer(fake.config(enable_lora=True)) as a, VllmServer(other.config(enable_lora=True)) as b:
        assert publish_lora_adapter([a, b], step1, 1, route, model_name="policy") == "policy-lora-1"
        assert publish_lora_adapter([a, b], step2, 2, route, model_name="policy") == "policy-lora-2"
        assert publish_lora_adapter([a, b], step2, 2, route, model_name="policy") == "policy-lora-2-2"
        assert a.lora_adapters == b.lora_adapters == {"policy-lora-2-2": step2}
        listed = httpx.get(f"{b.endpoint}/models").json()["data"]
        assert [model["id"] for model in listed] == ["policy", "policy-lora-2-2"]
    history = [("load", "policy-lora-1"), ("load", "policy-lora-2"), ("unload", "policy-lora-1")]
    history.append(("load", "policy-lora-2-2"))
    assert routed == [
        ("policy-lora-1", [history[:1]] * 2),
        ("policy-lora-2", [history[:2]] * 2),
        ("policy-lora-2-2", [history] * 2),
    ]
    for each in fakes:
        assert adapter_calls(each) == [*history, ("unload", "policy-lora-2")]
        paths = [c["body"]["lora_path"] for c in each.requests("/v1/load_lora_adapter")]
        assert paths == [str(step1), str(step2), str(step2)]


def test_api_key_is_sent_as_bearer_token(fake: FakeVllm) -> None:
    # fake_vllm answers /v1/models with 401 without the token, so becoming ready proves the header.
    with VllmServer(fake.config(api_key="k-123")) as server:
        assert httpx.get(f"{server.endpoint}/models").status_code == 401
        [start] = fake.starts()
        assert start["api_key_set"] is True
        assert "k-123" not in " ".join(start["argv"])


def test_startup_failure_reports_exit_code_and_log_tail(fake: FakeVllm) -> None:
    server = VllmServer(fake.config(env={"FAKE_VLLM_EXIT_CODE": "3"}))
    server.start()
    with pytest.raises(VllmError, match="exited with code 3") as failure:
        server.wait_ready()
    assert "fake vllm cannot load" in str(failure.value)
    server.stop()


def test_missing_executable_is_a_clear_error(fake: FakeVllm, tmp_path: Path) -> None:
    server = VllmServer(fake.config(executable=str(tmp_path / "no-such-vllm")))
    with pytest.raises(VllmError, match="cannot run"):
        server.start()


def test_readiness_timeout_stops_the_server_when_used_as_context_manager(fake: FakeVllm) -> None:
    server = VllmServer(fake.config(startup_timeout=5, env={"FAKE_VLLM_READY_AFTER": "60"}))
    with pytest.raises(VllmError, match=r"not ready after .*GET /health answered 503"), server:
        pass
    assert server.process is None
    [start] = fake.starts()
    assert _is_gone(start["pid"])
    assert _wait_until(lambda: _is_gone(start["engine_pid"]))


def test_crashed_server_is_restarted_with_its_last_weights_and_adapters(fake: FakeVllm, tmp_path: Path) -> None:
    server = VllmServer(fake.config(enable_lora=True), max_restarts=1)
    with server:
        assert server.restart_if_dead() is False
        step = _make_dir(tmp_path / "ckpt-3")
        adapter = _make_dir(tmp_path / "lora")
        server.reload_weights(step, version="step-3")
        server.load_lora_adapter("policy-lora", adapter, version="step-3")
        [first] = fake.starts()

        os.kill(first["pid"], signal.SIGKILL)
        assert _wait_until(lambda: not server.is_running())
        with pytest.raises(VllmError, match="exited with code -9"):
            server.reload_weights(step)

        assert server.restart_if_dead() is True
        assert server.restarts == 1
        assert _wait_until(lambda: _is_gone(first["engine_pid"])), "the dead server's engine child was left behind"
        assert len(fake.starts()) == 2
        replayed = [(c["path"], c["body"]) for c in fake.requests()][-3:]
        assert replayed == [
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(step)}}),
            ("/reset_prefix_cache", None),
            ("/v1/load_lora_adapter", {"lora_name": "policy-lora", "lora_path": str(adapter)}),
        ]
        assert server.weight_version == "step-3"

        os.kill(server.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        assert _wait_until(lambda: not server.is_running())
        with pytest.raises(VllmError, match=r"max_restarts=1"):
            server.restart_if_dead()
    second = fake.starts()[1]
    assert _wait_until(lambda: _is_gone(second["engine_pid"]))


def test_server_ignoring_sigterm_is_killed(fake: FakeVllm) -> None:
    server = VllmServer(fake.config(stop_timeout=0.3, env={"FAKE_VLLM_IGNORE_SIGTERM": "1"}))
    server.start()
    server.wait_ready()
    leader = server.process.pid  # type: ignore[union-attr]
    began = time.monotonic()
    server.stop()
    assert time.monotonic() - began < 3
    assert _is_gone(leader)


def test_admin_errors_name_the_route_and_status(fake: FakeVllm, tmp_path: Path) -> None:
    with VllmServer(fake.config(enable_lora=True)) as server:
        with pytest.raises(VllmRequestError, match=r"POST /v1/unload_lora_adapter answered 404") as failure:
            server.unload_lora_adapter("never-loaded")
        assert (failure.value.route, failure.value.status_code) == ("/v1/unload_lora_adapter", 404)
        with pytest.raises(VllmError, match="enable_sleep_mode"):
            server.sleep()
        with pytest.raises(ValueError, match="level"):
            VllmServer(fake.config(enable_sleep_mode=True)).sleep(level=3)
        with pytest.raises(FileNotFoundError, match="checkpoint_dir"):
            server.reload_weights(tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match="path"):
            server.load_lora_adapter("x", tmp_path / "missing")
    with pytest.raises(VllmError, match="was not started"):
        server.reload_weights(_make_dir(tmp_path / "ckpt"))


def test_weight_reload_off_means_no_dev_routes(fake: FakeVllm, tmp_path: Path) -> None:
    with VllmServer(fake.config(enable_weight_reload=False)) as server:
        assert fake.starts()[0]["env"]["VLLM_SERVER_DEV_MODE"] is None
        with pytest.raises(VllmError, match="enable_weight_reload"):
            server.reload_weights(_make_dir(tmp_path / "ckpt"))


# -- real vLLM --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_vllm_serves_token_ids_sleeps_and_reloads_weights(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lightning.models import build_tiny_model

    first = build_tiny_model(tmp_path / "tiny-0", seed=0)
    second = build_tiny_model(tmp_path / "tiny-1", seed=1)
    executable = shutil.which("vllm") or str(Path(sys.executable).parent / "vllm")
    config = VllmConfig(
        model=str(first),
        served_model_name="tiny",
        port=free_port(),
        executable=executable,
        gpu_memory_utilization=0.3,
        seed=0,
        enable_sleep_mode=True,
        extra_args=["--enforce-eager"],
    )

    def complete(server: VllmServer) -> dict[str, Any]:
        response = httpx.post(
            f"{server.endpoint}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return response.json()

    with VllmServer(config, log_path=tmp_path / "vllm.log") as server:
        answer = complete(server)
        assert answer["prompt_token_ids"] and all(isinstance(t, int) for t in answer["prompt_token_ids"])
        tokens = answer["choices"][0]["token_ids"]
        assert 1 <= len(tokens) <= 8 and all(isinstance(t, int) for t in tokens)

        server.sleep(level=1)
        assert server.is_sleeping()
        server.wake_up()
        assert not server.is_sleeping()
        assert complete(server)["choices"][0]["token_ids"] == tokens

        server.reload_weights(second, version="seed-1")
        assert server.weight_version == "seed-1"
        other = complete(server)["choices"][0]["token_ids"]
        server.reload_weights(first, version="seed-0")
        assert complete(server)["choices"][0]["token_ids"] == tokens
        assert other != tokens, "greedy output did not change with different weights: the reload had no effect"
    assert server.process is None
