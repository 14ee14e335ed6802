"""TrainConfig: YAML loading, dotted overrides, errors that name the field and the fix, datasets, agents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning.config import TrainConfig, load_agent, load_config, load_tasks, with_overrides
from lightning.config_file import apply_overrides, parse_overrides
from lightning.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_config_loads_and_overrides_apply() -> None:
    config = load_config("examples/copy_task/demo.yaml", **{"algorithm.lr": 5e-4, "iterations": 3})
    assert config.run_name == "demo" and config.iterations == 3 and config.algorithm.lr == 5e-4
    assert config.run_dir == Path(".lightning/runs/demo")


def test_a_flow_runs_overrides_onto_its_config() -> None:
    demo = load_config("examples/copy_task/demo.yaml")
    changed = with_overrides(demo, {"iterations": 2, "algorithm.lr": 1e-3, "run_name": "short"})
    assert (changed.iterations, changed.algorithm.lr, changed.run_name) == (2, 1e-3, "short")
    assert changed.batch_size == demo.batch_size and changed.algorithm.kl_coef == demo.algorithm.kl_coef
    assert with_overrides(demo, None) == demo
    with pytest.raises(ConfigError, match="algorithm.lrr: unknown field"):
        with_overrides(demo, {"algorithm.lrr": 1})
    with pytest.raises(ConfigError, match="overrides: give a mapping"):
        with_overrides(TrainConfig(), ["iterations=2"])  # type: ignore[arg-type]


def test_command_line_overrides_are_read_as_yaml_and_set_by_their_dots() -> None:
    overrides = parse_overrides(["iterations=3", "algorithm.lr=0.001", "sampling={max_tokens: 4}", "run_name=a=b"])
    assert overrides == {"iterations": 3, "algorithm.lr": 0.001, "sampling": {"max_tokens": 4}, "run_name": "a=b"}
    with pytest.raises(ConfigError, match="override 'iterations': write field=value"):
        parse_overrides(["iterations"])
    base = {"algorithm": {"lr": 0.1, "kl_coef": 0.0}, "iterations": 1}
    assert apply_overrides(base, {"algorithm.lr": 0.001, "checkpoint.keep_last": 2}) == {
        "algorithm": {"lr": 0.001, "kl_coef": 0.0},
        "iterations": 1,
        "checkpoint": {"keep_last": 2},
    }
    assert base == {"algorithm": {"lr": 0.1, "kl_coef": 0.0}, "iterations": 1}  # a copy: the caller's dict is kept
    with pytest.raises(ConfigError, match="override iterations.x: iterations is not a mapping"):
        apply_overrides(base, {"iterations.x": 1})


def test_every_config_field_is_described_for_the_run_form() -> None:
    from prefect.utilities.callables import parameter_schema

    from flows.train import train

    schema = parameter_schema(train).model_dump()
    assert all(spec.get("description") for spec in schema["properties"].values())
    undescribed = [
        f"{model}.{field}"
        for model, definition in schema["definitions"].items()
        for field, spec in definition.get("properties", {}).items()
        if not spec.get("description")
    ]
    assert undescribed == []


def test_errors_name_every_bad_field_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run_name: 'has space'\nbatch_size: 0\nalgorithm: {lrr: 1}\nagent: not-an-entry-point\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message
    assert "run_name: use letters, digits" in message
    assert "batch_size: Input should be greater than or equal to 1 (got 0)" in message
    assert "algorithm.lrr: unknown field" in message
    assert "agent: give the agent as module:function" in message


def test_file_problems_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("run_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_external_inference_needs_an_endpoint() -> None:
    with pytest.raises(ConfigError, match="backend 'external' needs `endpoint`"):
        load_config({"inference": {"backend": "external"}})


def test_the_proxy_serves_with_the_embedded_server_only_where_both_run_in_its_process() -> None:
    assert load_config({"inference": {"with_proxy": True}}).inference.with_proxy
    for inference in ({"in_process": True}, {"backend": "vllm"}, {"endpoint": "http://127.0.0.1:9/v1"}):
        with pytest.raises(ConfigError, match="inference: with_proxy: only for the embedded server the run starts"):
            load_config({"inference": {"with_proxy": True, **inference}})
    with pytest.raises(ConfigError, match="inference.with_proxy: .* proxy_in_process puts it in the flow's; choose"):
        load_config({"inference": {"with_proxy": True}, "proxy_in_process": True})


def test_device_and_dtype_settings_say_what_they_take() -> None:
    config = load_config({"algorithm": {"device": "cuda:1"}, "inference": {"device": "cpu", "dtype": "bfloat16"}})
    assert (config.algorithm.device, config.inference.device, config.inference.dtype) == ("cuda:1", "cpu", "bfloat16")
    assert (TrainConfig().algorithm.device, TrainConfig().inference.device, TrainConfig().inference.dtype) == (
        "auto", "auto", "auto",
    )  # fmt: skip
    with pytest.raises(ConfigError) as error:
        load_config({"algorithm": {"device": "gpu"}, "inference": {"device": "cuda0", "dtype": "bf16"}})
    message = str(error.value)
    assert "algorithm.device: give auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N" in message
    assert "inference.device: give auto" in message
    assert "inference.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in message
    with pytest.raises(ConfigError, match="inference: device: only the embedded server takes a device"):
        load_config({"inference": {"backend": "vllm", "device": "cuda"}})
    with pytest.raises(ConfigError, match="algorithm.device: the verl backend places its workers"):
        load_config({"trainer_backend": "verl", "algorithm": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="algorithm.pack_sequences: an option of the torch trainer; verl's own is "):
        load_config({"trainer_backend": "verl", "algorithm": {"pack_sequences": True}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_config_check_names_a_device_that_is_not_there(tmp_path: Path) -> None:
    from lightning import preflight

    config = load_config(
        {"algorithm": {"device": "cuda"}, "inference": {"device": "cuda:0"}, "store_url": f"sqlite:///{tmp_path}/s.db"}
        | {"agent": "examples.copy_task.agent:copy_agent", "train_data": "examples.copy_task.data:train_tasks"}
    )
    found = preflight.problems(config)
    assert [line.split(":")[0] for line in found] == ["algorithm.device", "inference.device"]
    assert found[0].endswith("set algorithm.device: cpu, or auto") and "torch sees no GPU here" in found[1]
    assert (
        preflight.problems(
            config.model_copy(
                update={"inference": config.inference.model_copy(update={"endpoint": "http://127.0.0.1:9/v1"})}
            )
        )
        == found[:1]
    )  # fmt: skip  (a server not ours: no device)


def test_no_dataset_is_assumed_and_evaluating_needs_only_the_held_out_tasks(tmp_path: Path) -> None:
    from lightning import preflight

    config = load_config(
        {"agent": "examples.copy_task.agent:copy_agent", "store_url": f"sqlite:///{tmp_path}/s.db"}
        | {"val_data": "examples.copy_task.data:val_tasks"}
    )
    assert config.train_data is None and TrainConfig().val_data is None
    assert preflight.problems(config) == [
        "train_data: not set; give the training tasks as a .jsonl or .parquet file (one task per row) or as "
        "module:function returning a list, e.g. `train_data: examples/first_agent/train.jsonl`"
    ]
    assert preflight.problems(config, training=False) == []  # what flows.evaluate and Run.open(train=False) check


def test_datasets_from_jsonl_parquet_and_entry_points(tmp_path: Path) -> None:
    rows = [{"letters": "bdfg", "target": "g"}, {"letters": "kmpb", "target": "b"}]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert load_tasks(str(jsonl)) == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert load_tasks(str(parquet)) == rows
    assert len(load_tasks("examples.copy_task.data:train_tasks")) == 4000
    assert not {t["letters"] for t in load_tasks("examples.copy_task.data:train_tasks")} & {
        t["letters"] for t in load_tasks("examples.copy_task.data:val_tasks")
    }


def test_dataset_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="val_data: no file"):
        load_tasks(str(tmp_path / "none.jsonl"), "val_data")
    (tmp_path / "bad.jsonl").write_text('{"ok": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="train_data: .*line 2 is not JSON"):
        load_tasks(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ConfigError, match="train_data: cannot import module 'no_such_module'"):
        load_tasks("no_such_module:tasks")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_tasks("examples.copy_task.data:nope")
    with pytest.raises(ConfigError, match="train_data: give a .jsonl or .parquet file"):
        load_config({"train_data": "tasks.csv"})


def test_agents_load_from_functions_and_classes() -> None:
    from lightning.agent import LitAgent

    assert isinstance(load_agent("examples.copy_task.agent:copy_agent"), LitAgent)
    with pytest.raises(ConfigError, match="agent: examples.copy_task.agent:reward is a function, not an agent"):
        load_agent("examples.copy_task.agent:reward")


def test_sampling_parameters_are_checked_one_line_per_key_naming_it() -> None:
    """`sampling` and `eval_sampling` are checked key by key against what the backends take (issue 40, item 10:
    `{temperature: hot, max_token: 4}` passed `config check` and failed 91 s later in the agent's call), strictly:
    the mapping reaches the server as written, so `max_tokens: 4.0` or `"4"` is refused here, not there."""
    with pytest.raises(ConfigError) as refused:
        load_config(
            {"sampling": {"temperature": "hot", "max_token": 4, "stop": 5}, "eval_sampling": {"max_tokens": 4.0}},
            **{"eval_sampling.seed": True, "eval_sampling.colour": 1},
        )
    assert str(refused.value).splitlines()[1:] == [
        "  sampling.temperature: Input should be a valid number (got 'hot')",
        "  sampling.stop: give a string or a list of strings (got 5)",
        "  sampling.max_token: unknown key; did you mean max_tokens?",
        "  eval_sampling.max_tokens: Input should be a valid integer (got 4.0)",
        "  eval_sampling.seed: Input should be a valid integer (got True) (set by the override eval_sampling.seed)",
        "  eval_sampling.colour: unknown key; known keys: temperature, top_p, top_k, min_p, max_tokens, "
        "max_completion_tokens, stop, seed, presence_penalty, frequency_penalty, repetition_penalty, logprobs, "
        "top_logprobs, n (set by the override eval_sampling.colour)",
    ]
    good = {"temperature": 1, "top_p": 0.9, "max_tokens": 4, "stop": ["\n"], "seed": 3, "logprobs": True, "n": 2}
    assert load_config({"sampling": good, "eval_sampling": {"stop": "."}}).sampling == good  # kept as written


def test_the_cli_prints_defaults_and_checks_files(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    defaults = subprocess.run(
        [sys.executable, "-m", "lightning.cli", "config", "defaults"], capture_output=True, text=True, check=True
    )
    assert load_config(yaml.safe_load(defaults.stdout)).run_name == "demo"
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 0\n")
    checked = subprocess.run(
        [sys.executable, "-m", "lightning.cli", "config", "check", str(bad)], capture_output=True, text=True
    )
    assert checked.returncode == 2 and "batch_size: Input should be greater than or equal to 1" in checked.stderr


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"train_data": "/nonexistent/train.jsonl"}, "train_data: no file /nonexistent/train.jsonl"),
        ({"agent": "no_such_module.agent:run"}, "agent: cannot import module 'no_such_module.agent'"),
        ({"model": "/nonexistent/model"}, "model: /nonexistent/model is not a Hugging Face model directory"),
        ({"store_url": "mysql://root@localhost/x"}, "store_url: give sqlite:///path.db, postgresql://"),
        ({"store_url": "postgresql://u:${NO_SUCH_VARIABLE}@h/db"}, "store_url: ${NO_SUCH_VARIABLE} names the"),
        # No agent is assumed: a config without one used to train the copy task's and fail a minute later.
        ({"agent": None}, "agent: not set; name the agent to train"),
        # Nor a dataset: a config without train_data used to train on the copy task's tasks without a word.
        ({"train_data": None}, "train_data: not set; give the training tasks as a .jsonl or .parquet file"),
        # Sampling parameters are checked by name and type before anything starts (they used to fail in the agent).
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature: Input should be a valid number (got 'hot')"),
        ({"eval_sampling": {"max_token": 4}}, "eval_sampling.max_token: unknown key; did you mean max_tokens?"),
    ],
)
def test_a_run_that_cannot_start_says_why_before_anything_starts(
    tmp_path: Path, change: dict[str, str], said: str
) -> None:
    config = {"run_name": "bad", "output_dir": str(tmp_path / "runs"), "store_url": f"sqlite:///{tmp_path}/s.db"}
    config |= {"agent": "examples.copy_task.agent:copy_agent", "train_data": "examples.copy_task.data:train_tasks"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in {**config, **change}.items() if value is not None}))
    commands = [
        [sys.executable, "-m", "flows.train", str(path)],
        [sys.executable, "-m", "lightning.cli", "config", "check", str(path)],
    ]
    for command in commands:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        problems = [line.strip() for line in done.stderr.splitlines() if line.startswith("  ")]
        assert len(problems) == 1 and problems[0].startswith(said), done.stderr
        # Before anything starts: no Prefect server, no traceback (how fast is a machine's business, not a test's).
        assert "Traceback" not in done.stderr and "Prefect server" not in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("model"))  # nothing started


def test_a_cosine_schedule_without_total_steps_spans_the_runs_iterations() -> None:
    config = load_config({"iterations": 12, "algorithm": {"lr_schedule": "cosine"}})
    assert config.algorithm.total_steps is None  # the config as given: a later --set iterations=... still applies
    assert config.update_config.total_steps == 12
    assert load_config({"algorithm": {"lr_schedule": "cosine", "total_steps": 5}}).update_config.total_steps == 5


def test_the_checks_name_an_api_key_the_config_names_and_the_environment_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning import preflight

    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    external = {"backend": "external", "endpoint": "http://127.0.0.1:9/v1", "api_key_env": "NO_SUCH_KEY"}
    apo = {"initial_prompt": "Pick a room. {request}", "api_key_env": "NO_SUCH_KEY"}
    config = load_config({"inference": external, "apo": apo})
    found = preflight.problems(config)
    assert (
        "inference.api_key_env: the environment variable NO_SUCH_KEY (the API key of http://127.0.0.1:9/v1) is "
        "not set; every rollout would fail without it" in found
    )
    assert not any(line.startswith("apo.") for line in found)  # a dry run needs no optimiser
    assert "apo.api_key_env: the environment variable NO_SUCH_KEY (the optimiser's key) is not set" in (
        preflight.problems(config, optimiser=True)
    )
    monkeypatch.setenv("NO_SUCH_KEY", "k")
    assert not any("api_key_env" in line for line in preflight.problems(config, optimiser=True))


@pytest.mark.slow
def test_prompt_optimisation_names_its_missing_keys_before_anything_starts(tmp_path: Path) -> None:
    """The README's APO example without OPENAI_API_KEY: the agent's endpoint and the optimiser both need it."""
    env = {name: value for name, value in os.environ.items() if name != "OPENAI_API_KEY"}
    where = ["--set", f"store_url=sqlite:///{tmp_path}/s.db", "--set", f"output_dir={tmp_path}/runs"]
    commands = [
        [sys.executable, "-m", "flows.optimize_prompt", "examples/room_booking/apo.yaml", *where],
        [sys.executable, "-m", "lightning.cli", "config", "check", "examples/room_booking/apo.yaml"],
    ]
    for command in commands:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "inference.api_key_env: the environment variable OPENAI_API_KEY" in done.stderr, done.stderr
        assert "apo.api_key_env: the environment variable OPENAI_API_KEY (the optimiser's key)" in done.stderr
        assert "Traceback" not in done.stderr and "Prefect server" not in done.stderr, done.stderr


def test_runner_processes_refuse_an_in_memory_store_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="store_url: 'sqlite://' is an in-memory SQLite store, which the runner"):
        load_config({"task_runner": "processes", "store_url": "sqlite://"})
    assert load_config({"task_runner": "processes", "store_url": "sqlite:///runs/store.db"}).task_runner == "processes"
