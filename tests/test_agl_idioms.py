"""agent-lightning 0.3 idioms on our runner and store: bool rewards, `emit_reward` keywords, `trained_agents`,
`self.runner` / `self.tracer` / `self.trainer`, spans returned with propagate=False, and `import lightning as agl`
giving the names an agent or a training script uses (without importing Prefect). The Trainer's flows are in
test_agl_trainer.py."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import lightning as agl
from lightning.config import TrainConfig
from lightning.errors import ConfigError
from lightning.trainer import REGISTRY_SPEC, Trainer, registry

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    store = agl.SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    yield store
    await store.close()


async def final_reward(store: Any, rollout_id: str) -> float | None:
    return agl.find_final_reward(await store.query_spans(rollout_id))


@pytest.mark.parametrize(("answer", "reward"), [(True, 1.0), (False, 0.0)])
async def test_a_rollout_that_returns_a_bool_earns_one_or_zero(store: Any, answer: bool, reward: float) -> None:
    @agl.rollout
    def agent(task: dict[str, Any]) -> bool:
        return task["answer"]

    runner = agl.Runner(agent, store)
    finished = await runner.step({"answer": answer})
    assert finished.status == "succeeded" and await final_reward(store, finished.rollout_id) == reward
    await runner.close()


class WriterAgent(agl.LitAgent[dict[str, Any]]):
    """Written as for agent-lightning 0.3: `trained_agents`, `self.runner` / `self.tracer`, a dict of rewards."""

    def __init__(self) -> None:
        super().__init__(trained_agents="write")
        self.seen: list[tuple[Any, Any]] = []

    async def rollout_async(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> None:
        self.seen.append((self.runner, self.tracer))
        assert self.tracer.get_langchain_handler() is None  # LLM calls are recorded by the proxy instead
        agl.emit_reward(
            {"correct": task["x"] == 2, "brevity": 0.5}, primary_key="correct", attributes={"agent": "write"}
        )


class NoInitAgent(agl.LitAgent[Any]):
    def rollout(self, task: Any, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        return 0.25 if self.tracer is self.runner.tracer else -1.0


async def test_a_lit_agent_knows_its_runner_and_tracer_and_keeps_trained_agents(store: Any) -> None:
    agent = WriterAgent()
    assert agent.trained_agents == "write" and NoInitAgent().trained_agents is None
    with pytest.raises(ValueError, match=r"WriterAgent\.tracer .* no runner is using it"):
        agent.tracer  # noqa: B018
    with pytest.raises(ValueError, match=r"WriterAgent\.trainer: no Trainer .*fit\(agent"):
        agent.trainer  # noqa: B018
    # Two runners share the agent (as a run's runner tasks do): each rollout sees the runner running it.
    first, second = agl.Runner(agent, store), agl.Runner(agent, store)
    one, two = await asyncio.gather(first.step({"x": 2}), second.step({"x": 3}))
    assert sorted((id(runner), id(tracer)) for runner, tracer in agent.seen) == sorted(
        [(id(first), id(first.tracer)), (id(second), id(second.tracer))]
    )
    assert await final_reward(store, one.rollout_id) == 1.0 and await final_reward(store, two.rollout_id) == 0.0
    (span,) = [s for s in await store.query_spans(one.rollout_id) if s.name == "lightning.reward"]
    assert span.attributes["agent"] == "write" and span.attributes["lightning.reward.brevity"] == 0.5
    # A subclass without __init__ works too, and a sync agent (run on a thread) sees its runner.
    plain = agl.Runner(NoInitAgent(), store)
    assert await final_reward(store, (await plain.step({})).rollout_id) == 0.25
    for runner in (first, second, plain):
        await runner.close()
    # Pickled (to another process), it leaves its runner behind.
    assert pickle.loads(pickle.dumps(NoInitAgent())).__dict__ == {"trained_agents": None}
    agent.seen.clear()
    copy = pickle.loads(pickle.dumps(agent))
    assert copy.trained_agents == "write" and copy._runner_ref is None


async def test_spans_made_with_propagate_false_and_returned_are_stored(store: Any) -> None:
    @agl.rollout
    def agent(task: Any) -> list[Any]:
        return [
            agl.emit_message("thinking", attributes={"turn": 1}, propagate=False),
            agl.emit_reward(0.5, propagate=False),
        ]

    runner = agl.Runner(agent, store)
    finished = await runner.step({})
    spans = await store.query_spans(finished.rollout_id)
    assert [span.name for span in spans] == ["lightning.message", "lightning.reward"]
    assert spans[0].attributes == {"turn": 1, "lightning.message.body": "thinking"}
    assert agl.find_final_reward(spans) == 0.5
    await runner.close()


async def test_an_agent_that_overrides_is_async_as_a_method_runs(store: Any) -> None:
    class Agent(agl.LitAgent[Any]):
        def is_async(self) -> bool:  # type: ignore[override]  # agent-lightning's is a method
            return False

        def rollout(self, task: Any, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
            return 0.5 if threading.current_thread() is not threading.main_thread() else -1.0

    runner = agl.Runner(Agent(), store)
    assert await final_reward(store, (await runner.step({})).rollout_id) == 0.5
    await runner.close()


async def test_agl_s_reward_decorator_emits_what_the_function_returns(store: Any) -> None:
    from lightning.reward import reward

    @reward
    def judge(answer: str) -> float:
        return 0.75 if answer == "4" else 0.0

    @reward
    async def judge_async(answer: str) -> float | None:
        return 0.25 if answer else None  # None: returned, not emitted

    @agl.rollout
    async def agent(task: dict[str, Any]) -> None:
        assert judge("4") == 0.75 and await judge_async("") is None
        await judge_async("x")

    runner = agl.Runner(agent, store)
    finished = await runner.step({})
    spans = await store.query_spans(finished.rollout_id)
    assert [agl.get_reward_value(span) for span in agl.find_reward_spans(spans)] == [0.75, 0.25]
    await runner.close()


async def test_an_in_memory_store_and_agl_s_client_by_their_agl_names(tmp_path: Path) -> None:
    from conftest import serving

    from lightning.store import InMemoryLightningStore, LightningStoreClient
    from lightning.store.server import create_app

    async with InMemoryLightningStore(watchdog_interval=None) as memory:
        runner = agl.Runner(NoInitAgent(), memory)
        assert await final_reward(memory, (await runner.step({})).rollout_id) == 0.25
        await runner.close()

    served = agl.SqlLightningStore(f"sqlite:///{tmp_path}/served.db", watchdog_interval=None, threaded=False)
    with serving(create_app(served)) as url:
        client = LightningStoreClient(url, retry_delays=(), request_timeout=5.0)
        rollout = await client.enqueue_rollout({"x": 1})
        assert [r.rollout_id for r in await client.query_rollouts()] == [rollout.rollout_id]
        assert client.server_address == url
        await client.close()
    await served.close()


def test_import_lightning_as_agl_names_what_agents_and_scripts_use_without_prefect() -> None:
    names = [
        "LitAgent", "rollout", "llm_rollout", "prompt_rollout", "emit_reward", "emit_message", "emit_object",
        "emit_exception", "operation", "find_final_reward", "get_reward_value", "Trainer", "Runner", "LitAgentRunner",
        "Tracer", "LLM", "ProxyLLM", "PromptTemplate", "NamedResources", "Dataset", "Rollout", "AttemptedRollout",
        "Span", "SpanCoreFields", "Triplet", "Hook", "LightningStore", "setup_logging", "configure_logger",
        "VERL", "APO", "Algorithm", "algo", "LightningEnvVar", "resolve_bool_env_var", "resolve_str_env_var",
        "LLMProxy", "LightningStoreServer", "TracerTraceToTriplet", "LlmProxyTraceToTriplet", "Baseline",
        "SharedMemoryExecutionStrategy", "emit_annotation", "get_active_tracer", "SpanNames",
    ]  # fmt: skip
    code = (
        "import json, sys\n"
        "import lightning as agl\n"
        f"missing = [n for n in {names!r} if not hasattr(agl, n)]\n"
        "layers = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'flows', 'tasks', 'torch'))\n"
        "try:\n    agl.Task\n    task = ''\nexcept ImportError as exc:\n    task = str(exc)\n"
        "print(json.dumps({'missing': missing, 'layers': layers, 'task': task}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["missing"] == [] and found["layers"] == []
    assert "deprecated 0.1/0.2 API" in found["task"]


# --- the Trainer's configuration (its flows run in test_agl_trainer.py) ---


LLM_M = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="m", sampling_parameters={})


@agl.rollout
def module_level_agent(task: dict[str, Any], llm: agl.LLM) -> bool:
    return True


def test_the_trainer_maps_agent_lightning_s_arguments_onto_a_train_config(tmp_path: Path) -> None:
    trainer = Trainer(
        n_workers=3,
        algorithm={"lr": 1e-4, "kl_coef": 0.0},
        store=f"sqlite:///{tmp_path}/s.db",
        initial_resources={"main_llm": LLM_M.model_copy(update={"sampling_parameters": {"temperature": 0.5}})},
        config={"iterations": 7, "batch_size": 2},
        batch_size=4,
        output_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    config = trainer.build_config(module_level_agent, [{"q": 1}, {"q": 2}], val_dataset=[{"q": 3}])
    assert config.agent == "test_agl_idioms:module_level_agent"  # importable: named by its module
    assert (config.n_runners, config.iterations, config.batch_size) == (3, 7, 4)
    assert (config.algorithm.lr, config.algorithm.kl_coef) == (1e-4, 0.0)
    assert config.store_url == f"sqlite:///{tmp_path}/s.db" and config.run_name == "module_level_agent"
    assert (config.inference.backend, config.inference.endpoint, config.inference.served_model_name) == (
        "external", "http://127.0.0.1:9/v1", "m"
    )  # fmt: skip
    assert config.sampling == {"temperature": 0.5}
    assert [json.loads(line) for line in Path(config.train_data).read_text().splitlines()] == [{"q": 1}, {"q": 2}]
    assert Path(config.val_data).parent == tmp_path.resolve() / "runs" / "module_level_agent" / "data"
    # An agent no module holds goes to the registry, which a Ray worker cannot see.
    local = WriterAgent()
    spec = Trainer().build_config(local, [{"x": 2}]).agent
    assert spec.startswith(REGISTRY_SPEC) and getattr(registry, spec.rsplit(".", 1)[1]) is local
    with pytest.raises(ValueError, match="task_runner 'ray'.*importable module"):
        Trainer(task_runner="ray", store="http://127.0.0.1:9").build_config(local, [{"x": 2}])


def test_the_trainer_s_runs_serve_agents_that_send_a_key_of_their_own_as_agl_s_do() -> None:
    # agl's agents send "dummy" or their OPENAI_API_KEY to the LLM proxy; a config run's proxy needs the token.
    assert Trainer().build_config(module_level_agent, [{"q": 1}]).proxy_any_agent_key is True
    strict = Trainer(proxy_any_agent_key=False).build_config(module_level_agent, [{"q": 1}])
    assert strict.proxy_any_agent_key is False
    assert TrainConfig().proxy_any_agent_key is False


def test_initial_resources_take_named_llms_and_prompt_templates(tmp_path: Path) -> None:
    prompt = agl.PromptTemplate(template="Say {word}", engine="f-string")
    judge = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="judge")
    only_prompts = Trainer(initial_resources={"main_prompt": prompt}, output_dir=str(tmp_path))
    config = only_prompts.build_config(module_level_agent, [{"q": 1}])
    assert (config.inference.backend, config.llm_resource_name) == ("embedded", "main_llm")  # the run's own model
    assert config.resources == {"main_prompt": prompt}
    several = Trainer(initial_resources={"main_llm": LLM_M, "judge": judge, "prompt_template": prompt})
    config = several.build_config(module_level_agent, [{"q": 1}])
    assert (config.inference.endpoint, config.llm_resource_name) == ("http://127.0.0.1:9/v1", "main_llm")
    assert config.resources == {"judge": judge, "prompt_template": prompt}
    named = Trainer(initial_resources={"policy": LLM_M}).build_config(module_level_agent, [{"q": 1}])
    assert (named.llm_resource_name, named.resources) == ("policy", {})


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"max_rollouts": 4}, TypeError, "max_rollouts= is not supported here: .*iterations="),
        ({"tracer": "agentlightning.OtelTracer"}, TypeError, r"give lightning.OtelTracer\(\) or AgentOpsTracer"),
        ({"adapter": {"agent_match": "write"}}, ValueError, "give that agent an LLM resource other than the trained"),
        ({"adapter": {"llm_call_match": "chat"}}, ValueError, "leave llm_call_match out"),
        ({"adapter": {"repair_hierarchy": False}}, ValueError, "always places a span"),
        ({"strategy": "mystery"}, TypeError, "give 'shm' or 'cs'"),
        ({"strategy": {"type": "cs", "role": "runner"}}, ValueError, "task_runner='ray'"),
        ({"triplet_exporter": object()}, TypeError, "adapter=TracerTraceToTriplet"),
        ({"llm_proxy": object()}, TypeError, "proxy_endpoint="),
        ({"hooks": [object()]}, TypeError, "Runner\\(agent, store, hooks="),
        ({"dev": True}, TypeError, r"\.dev\(agent"),
        ({"algorithm": object()}, TypeError, "TrainerConfig"),
        ({"algorithm": {"data": {"train_batch_size": 8}}}, ValueError, "looks like a verl config"),
        ({"algorithm": {"lr": -1}}, ConfigError, "algorithm.lr"),
        ({"n_runners": 2, "n_workers": 3}, ValueError, "disagree"),
        ({"store": object()}, TypeError, "give the URL"),
        ({"initial_resources": {"a": LLM_M, "b": LLM_M}}, ValueError, "name the one the run trains 'main_llm'"),
        ({"initial_resources": {"p": "a prompt"}}, TypeError, r"\['p'\] are not lightning.LLM"),
        ({"initial_resources": {"m": LLM_M.model_copy(update={"api_key": "k"})}}, ValueError, "api_key_env"),
        ({"iteratons": 3}, ConfigError, "iteratons: unknown field"),
    ],
)  # fmt: skip
def test_the_trainer_refuses_what_it_cannot_honour_and_says_what_to_use(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Trainer(**arguments)


def test_fit_refuses_what_is_not_an_agent_or_a_dataset() -> None:
    with pytest.raises(TypeError, match="give a LitAgent instance"):
        Trainer().fit(lambda task: 1.0, [{"x": 1}])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"train_dataset\[0\] cannot be written as JSON"):
        Trainer().build_config(module_level_agent, [object()])
    with pytest.raises(ValueError, match="give train_dataset"):
        Trainer().build_config(module_level_agent)
