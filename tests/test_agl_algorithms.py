"""agent-lightning's training entry points on ours, in agl's forms with only the imports changed: `env_var`'s
helpers, `Trainer(algorithm=VERL(config))` (mapped onto the `train` flow; refused in one line without a GPU stack),
`Trainer(algorithm=APO(client, ...))` (the `optimize_prompt` flow's `apo` section) and `@algo` / `Algorithm`
custom algorithms run against the store while the Trainer's runners run the agent."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

import lightning as agl
from lightning.adapter import TraceToMessages
from lightning.algorithm import algo
from lightning.env_var import LightningEnvVar, resolve_bool_env_var, resolve_int_env_var, resolve_str_env_var
from lightning.store import LightningStore

# --- env_var ------------------------------------------------------------------------------------------------------


def test_env_var_helpers_read_override_then_variable_then_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGL_MANAGED_STORE", raising=False)
    assert resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, fallback=True) is True
    monkeypatch.setenv("AGL_MANAGED_STORE", " Off ")
    assert resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, fallback=True) is False
    assert resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, True, fallback=False) is True
    monkeypatch.setenv("AGL_MANAGED_STORE", "maybe")
    with pytest.raises(ValueError, match="AGL_MANAGED_STORE='maybe'"):
        resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE)
    monkeypatch.setenv("AGL_SERVER_PORT", "4747")
    assert resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, fallback=1) == 4747
    assert resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, 9) == 9
    monkeypatch.setenv("AGL_SERVER_PORT", "port")
    with pytest.raises(ValueError, match="give an integer"):
        resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT)
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
    assert resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE) is None
    assert resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE, fallback="both") == "both"
    # Ours are there too, under their own names.
    monkeypatch.setenv("LIGHTNING_STORE_URL", "sqlite:///x.db")
    assert resolve_str_env_var(LightningEnvVar.LIGHTNING_STORE_URL) == "sqlite:///x.db"
    assert agl.LightningEnvVar is LightningEnvVar


@agl.rollout
def constant_agent(task: Any) -> float:
    return 1.0


def test_a_split_role_is_refused_with_how_to_run_runners_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_CURRENT_ROLE", "runner")
    with pytest.raises(RuntimeError, match=r"AGL_CURRENT_ROLE=runner: .*task_runner='ray'"):
        agl.Trainer(n_runners=1).fit(constant_agent, [{"x": 1}])


# --- VERL ---------------------------------------------------------------------------------------------------------


def verl_config() -> dict[str, Any]:
    """A verl config as agl's training scripts write one."""
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 4, "max_prompt_length": 64, "max_response_length": 4},
        "actor_rollout_ref": {
            "rollout": {"n": 2, "name": "vllm", "gpu_memory_utilization": 0.6, "multi_turn": {"format": "hermes"}},
            "actor": {
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_gpu": 8,
                "optim": {"lr": 1e-3},
                "use_kl_loss": False,
                "kl_loss_coef": 0.0,
                "entropy_coeff": 0,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.3,
                "fsdp_config": {"param_offload": True, "optimizer_offload": True},
            },
            "model": {"path": "tiny", "use_remove_padding": True, "enable_gradient_checkpointing": True},
        },
        "trainer": {
            "n_gpus_per_node": 1,
            "logger": ["console", "wandb"],
            "project_name": "AgentLightningTest",
            "experiment_name": "agl-verl",
            "test_freq": -1,
            "total_epochs": 1,
        },
    }


def test_verl_maps_agl_s_config_onto_the_train_flow() -> None:
    verl = agl.VERL(verl_config())
    assert verl.fields == {
        "trainer_backend": "verl",
        "batch_size": 4,
        "max_prompt_length": 64,
        "max_response_length": 4,
        "samples_per_task": 2,
        "model": "tiny",
        "algorithm": {
            "lr": 1e-3,
            "micro_batch_size": 8,
            "clip_low": 0.2,
            "clip_high": 0.3,
            "entropy_coef": 0,
            "use_kl_loss": False,
            "kl_in_reward": False,
            "advantage": "grpo",
            "mini_batch_size": 8,  # verl's 4 prompts x rollout.n
        },
        "run_name": "agl-verl",
        "experiment": "AgentLightningTest",
        "verl": {
            "n_gpus_per_node": 1,
            "param_offload": True,
            "optimizer_offload": True,
            "gradient_checkpointing": True,
            "use_remove_padding": True,
        },
        "inference": {"backend": "vllm", "vllm": {"gpu_memory_utilization": 0.6}},
        "eval_every": 0,
        # verl samples data.max_response_length tokens, at temperature 1 in training and greedily in validation.
        "sampling": {"temperature": 1.0, "max_tokens": 4},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 4},
    }
    assert verl.ignored == ["actor_rollout_ref.rollout.multi_turn.format", "trainer.logger"]
    # total_epochs: verl's steps, full batches of the training set per epoch.
    assert verl.run_fields(10)["iterations"] == 2
    torch = agl.VERL(verl_config(), trainer_backend="torch").fields
    assert "verl" not in torch and "inference" not in torch and torch["trainer_backend"] == "torch"
    assert torch["algorithm"]["gradient_checkpointing"] and torch["algorithm"]["pack_sequences"]
    config = copy.deepcopy(verl_config())
    config["algorithm"]["adv_estimator"] = "gae"
    with pytest.raises(ValueError, match="adv_estimator 'gae' has no counterpart"):
        agl.VERL(config)


def test_verl_without_a_gpu_stack_is_refused_in_one_line_naming_the_torch_mapping(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    trainer = agl.Trainer(algorithm=agl.VERL(verl_config()), n_runners=1, output_dir=str(tmp_path))
    with pytest.raises(RuntimeError) as refused:
        trainer.fit(constant_agent, [{"x": 1}] * 4)
    message = str(refused.value)
    assert "\n" not in message and "no CUDA device" in message
    assert "lightning.VERL(config, trainer_backend='torch')" in message


@pytest.fixture(scope="module")
def prefect_server() -> Any:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_verl_s_config_trains_on_the_torch_trainer_when_asked(tmp_path: Path, prefect_server: None) -> None:
    from support.agl_letter_agent import LetterAgent, letter_tasks

    config = verl_config()
    config["trainer"]["total_training_steps"] = 1
    trainer = agl.Trainer(
        algorithm=agl.VERL(config, trainer_backend="torch"),
        n_runners=1,
        sampling={"temperature": 1.0, "max_tokens": 2},
        eval_sampling={"temperature": 0.0, "max_tokens": 2},
        store_url=f"sqlite:///{tmp_path}/store.db",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        output_dir=str(tmp_path / "runs"),
    )
    tasks = letter_tasks()
    summary = trainer.fit(LetterAgent(), tasks, val_dataset=tasks[:2])
    assert summary["run_name"] == "agl-verl" and summary["iterations"] == 1
    assert trainer.config is not None and trainer.config.samples_per_task == 2
    assert trainer.config.algorithm.lr == 1e-3 and trainer.config.algorithm.mini_batch_size == 8


# --- APO ----------------------------------------------------------------------------------------------------------


def test_apo_becomes_the_optimize_prompt_flow_s_apo_section(monkeypatch: pytest.MonkeyPatch) -> None:
    from openai import AsyncOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    client = AsyncOpenAI(base_url="http://127.0.0.1:9/v1")
    algorithm = agl.APO[dict](client, val_batch_size=2, gradient_batch_size=2, beam_width=2, branch_factor=2,
                              beam_rounds=1, _poml_trace=True)  # fmt: skip
    seed = agl.PromptTemplate(template="Answer {question}", engine="f-string")
    trainer = agl.Trainer(
        algorithm=algorithm, n_runners=2, initial_resources={"system": seed}, adapter=TraceToMessages()
    )
    config = trainer.build_config(constant_agent, [{"question": "a"}], [{"question": "b"}])
    assert config.apo is not None and config.resources == {}
    assert (config.apo.initial_prompt, config.apo.resource_name) == ("Answer {question}", "system")
    assert (config.apo.gradient_model, config.apo.apply_edit_model) == ("openai/gpt-5-mini", "openai/gpt-4.1-mini")
    assert (config.apo.api_base, config.apo.api_key_env) == ("http://127.0.0.1:9/v1", "OPENAI_API_KEY")
    assert (config.apo.beam_width, config.apo.beam_rounds, config.apo.val_batch_size) == (2, 1, 2)
    # A key that is in no variable cannot reach the run's processes; no seed prompt, nothing to optimise.
    with pytest.raises(ValueError, match=r"api_key_env='NAME'"):
        agl.APO(AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-other"))
    with pytest.raises(ValueError, match="APO optimises one prompt template"):
        agl.Trainer(algorithm=algorithm)
    with pytest.raises(TypeError, match="TraceToMessages and adapters of your own are for APO"):
        agl.Trainer(algorithm={"lr": 1e-5}, adapter=TraceToMessages())
    with pytest.raises(TypeError, match="APO reads its rollouts as messages"):
        agl.Trainer(algorithm=algorithm, initial_resources={"system": seed}, adapter=agl.LlmProxyTraceToTriplet())


# --- Algorithm and @algo ------------------------------------------------------------------------------------------


@agl.rollout
async def prompt_agent(task: str, prompt_template: agl.PromptTemplate) -> float:
    return 1.0 if "friendly" in prompt_template.format(any_question=task) else 0.25


@algo
async def pick_a_prompt(*, store: LightningStore) -> None:
    """agl's custom-algorithm form: publish a prompt, enqueue a task, wait for it, read its reward."""
    for prompt in ("You are a helpful assistant. {any_question}", "You are a friendly chatbot. {any_question}"):
        await store.add_resources({"main_prompt": agl.PromptTemplate(template=prompt, engine="f-string")})
        rollout = await store.enqueue_rollout(input="Why is the sky blue?", mode="train")
        for _ in range(60):
            done = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=0.01)
            if done:
                break
            await asyncio.sleep(0.5)
        assert done and done[0].status == "succeeded"
        PICKED.append((prompt, agl.find_final_reward(await store.query_spans(rollout.rollout_id))))


PICKED: list[tuple[str, float | None]] = []


def test_an_algo_function_runs_against_the_store_while_the_trainer_s_runners_run_the_agent() -> None:
    PICKED.clear()
    assert agl.Trainer(n_workers=1, algorithm=pick_a_prompt).fit(prompt_agent) is None
    assert [reward for _, reward in PICKED] == [0.25, 1.0]


class EveryTask(agl.Algorithm):
    """agl's `Algorithm` subclass form, with the datasets and the initial resources."""

    def __init__(self) -> None:
        super().__init__()
        self.rewards: list[float | None] = []

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        store = self.get_store()
        await store.add_resources(self.get_initial_resources())
        rollouts = [await store.enqueue_rollout(input=task, mode="train") for task in train_dataset]
        ids = [rollout.rollout_id for rollout in rollouts]
        while len(await store.wait_for_rollouts(rollout_ids=ids, timeout=0.5)) < len(ids):
            pass
        self.rewards = [agl.find_final_reward(await store.query_spans(rollout_id)) for rollout_id in ids]
        assert isinstance(self.get_adapter(), TraceToMessages) and self.get_trainer() is not None


def test_an_algorithm_subclass_gets_the_datasets_and_the_initial_resources(tmp_path: Path) -> None:
    algorithm = EveryTask()
    seed = agl.PromptTemplate(template="You are a friendly chatbot. {any_question}", engine="f-string")
    trainer = agl.Trainer(
        n_runners=2,
        algorithm=algorithm,
        initial_resources={"main_prompt": seed},
        adapter=TraceToMessages(),
        store=f"sqlite:///{tmp_path}/store.db",
    )
    trainer.fit(prompt_agent, ["a", "b", "c"])
    assert algorithm.rewards == [1.0, 1.0, 1.0]
    with pytest.raises(TypeError, match="pick_a_prompt takes no train_dataset"):
        agl.Trainer(n_runners=1, algorithm=pick_a_prompt).fit(prompt_agent, ["a"])


def test_baseline_runs_every_task_through_the_runners_and_logs_what_came_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """agl's `Baseline` (apo_debug.py's trainer mode, with the algorithm named): its train then val tasks, logged."""
    baseline = agl.Baseline(polling_interval=0.05, max_queue_length=1, span_verbosity="key_values")
    seed = agl.PromptTemplate(template="You are a friendly chatbot. {any_question}", engine="f-string")
    trainer = agl.Trainer(n_runners=2, algorithm=baseline, initial_resources={"main_prompt": seed})
    with caplog.at_level("INFO", logger="lightning.agl_algorithms"):
        assert trainer.dev(prompt_agent, ["a", "b"], val_dataset=["c"]) is None  # a FastAlgorithm runs with dev too
    assert sorted((r.input, r.mode, r.status) for r in baseline.finished) == [
        ("a", "train", "succeeded"), ("b", "train", "succeeded"), ("c", "val", "succeeded"),
    ]  # fmt: skip
    assert "lightning.reward.value': 1.0" in caplog.text and "adapted: []" in caplog.text  # no LLM call, no triplet
    assert isinstance(baseline, agl.FastAlgorithm) and isinstance(baseline, agl.Algorithm)
    with pytest.raises(ValueError, match="train_split"):
        agl.Baseline(train_split=1.0)
    with pytest.raises(TypeError, match="dev runs a FastAlgorithm"):
        agl.Trainer(algorithm=pick_a_prompt).dev(prompt_agent, ["a"])
