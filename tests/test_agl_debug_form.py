"""agent-lightning 0.3's way of debugging one agent, with agents of our own: `LitAgentRunner(tracer)` with agl's
tracer names (`OtelTracer`, `AgentOpsTracer`), an `InMemoryLightningStore`, `runner.run_context(agent=, store=)`,
then `step(task, resources={...})` or `iter()`; a `Hook` reads the trace with `tracer.get_last_trace()`. Only the
import lines would differ in agl code. An agent that calls `OpenAI()` itself, as agl's room selector does, has its
calls stored as GenAI spans of its rollout (lightning.tracing.instrument); apo_debug.py's trainer mode,
`Trainer(...).dev`, reports such rollouts and why they make no training batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from openai import AsyncOpenAI, OpenAI
from support.scripted_agl import scripted_room_app
from support.scripted_openai import scripted_calculator_app
from support.servers import serving

import lightning as agl
from lightning.adapter import TraceToMessages, spans_to_triplets
from lightning.litagent import LitAgent, rollout
from lightning.reward import find_final_reward
from lightning.runner import LitAgentRunner
from lightning.store import InMemoryLightningStore
from lightning.tracer import AgentOpsTracer, OtelTracer, Tracer
from lightning.types import Hook, PromptTemplate, Rollout


@rollout
async def greeter(task: str, prompt_template: PromptTemplate) -> float:
    if task == "fail":
        raise RuntimeError("the agent failed on purpose")
    return 1.0 if prompt_template.format(name=task) == "Hello, Ada!" else 0.0


class TraceRecorder(Hook):
    """agl's hook signature: `on_trace_end` gets the runner's tracer, whose last trace it reads."""

    def __init__(self) -> None:
        self.traces: list[list[str]] = []

    async def on_trace_end(  # type: ignore[override]
        self, *, agent: LitAgent[str], runner: LitAgentRunner[str], tracer: Any, rollout: Rollout
    ) -> None:
        self.traces.append([span.name for span in tracer.get_last_trace()])


async def test_the_runner_steps_an_agent_with_agl_s_tracer_and_an_in_memory_store() -> None:
    tracer = OtelTracer()
    runner = LitAgentRunner[str](tracer)
    store = InMemoryLightningStore()
    prompt = PromptTemplate(template="Hello, {name}!", engine="f-string")
    hook = TraceRecorder()
    with pytest.raises(RuntimeError, match="inside `with runner.run_context"):
        await runner.step("Ada", resources={"main_prompt": prompt})

    with runner.run_context(agent=greeter, store=store, hooks=[hook]):
        finished = await runner.step("Ada", resources={"main_prompt": prompt})
        again = await runner.step("Ada")  # no resources: the latest ones, as in agl
        with pytest.raises(RuntimeError, match="on purpose"):  # agl's step raises what the agent raised
            await runner.step("fail")

    assert finished.status == again.status == "succeeded"
    assert find_final_reward(await store.query_spans(finished.rollout_id)) == 1.0
    assert find_final_reward(await store.query_spans(again.rollout_id)) == 1.0
    (failed,) = [r for r in await store.query_rollouts() if r.input == "fail"]
    assert failed.status == "failed"
    assert hook.traces[0] == ["lightning.reward"]
    assert tracer.store is store  # run_context handed the store to the tracer
    with pytest.raises(ValueError, match="make another tracer"):
        tracer.init_worker(0, InMemoryLightningStore())
    tracer.shutdown()
    await store.close()


async def test_iter_runs_what_an_algorithm_enqueued_with_agentops_s_tracer_name() -> None:
    store = InMemoryLightningStore()
    await store.add_resources({"main_prompt": PromptTemplate(template="Hello, {name}!", engine="f-string")})
    queued = [await store.enqueue_rollout(name, mode="train") for name in ("Ada", "Bob")]
    runner = LitAgentRunner[str](tracer=AgentOpsTracer(), max_rollouts=2, poll_interval=0.1)
    with runner.run_context(agent=greeter, store=store):
        assert await runner.iter() == 2
    done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in queued], timeout=5)
    rewards = [find_final_reward(await store.query_spans(r.rollout_id)) for r in done]
    assert sorted(rewards) == [0.0, 1.0]  # type: ignore[type-var]
    await store.close()


# --- LLM calls made with the agent's own OpenAI client (not through the run's LLM proxy) ---

ROOM_REQUEST = "Date: 2025-10-13. Time: 10:00. Duration: 30 min. Attendees: 3. Needs: tv. Accessible: no"
ROOM_TOOL = {
    "type": "function",
    "function": {"name": "get_rooms_and_availability", "description": "Rooms", "parameters": {"type": "object"}},
}


@rollout
def own_client_agent(task: str) -> float:
    """As agl's room selector: `OpenAI()` from the environment, a tool call, its result, the answer."""
    client = OpenAI(max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    first = client.chat.completions.create(
        model="scripted", messages=messages, tools=[ROOM_TOOL], extra_headers={"X-Custom-Auth": "header-secret"}
    ).choices[0]
    (call,) = first.message.tool_calls or []
    rooms = [{"id": "Orion", "capacity": 4, "equipment": ["tv"], "accessible": True, "free": True}]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(rooms)},
    ]
    answer = client.chat.completions.create(model="scripted", messages=messages).choices[0].message.content
    return 1.0 if answer and answer.endswith("final_choice: Orion") else 0.0


async def test_calls_with_the_agent_s_own_client_are_stored_as_genai_spans_that_adapt_to_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = scripted_room_app()
    with serving(app) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-agent-secret")
        store = InMemoryLightningStore()
        runner = LitAgentRunner[str](OtelTracer())
        with runner.run_context(agent=own_client_agent, store=store):
            finished = await runner.step(ROOM_REQUEST)
        OpenAI(max_retries=0).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": ROOM_REQUEST}]
        )
    assert len(app.state.requests) == 3

    spans = await store.query_spans(finished.rollout_id)
    # the two calls of the rollout, not the call outside it
    assert [span.name for span in spans] == ["openai.chat.completion", "openai.chat.completion", "lightning.reward"]
    assert find_final_reward(spans) == 1.0
    first = spans[0].attributes
    assert (first["gen_ai.operation.name"], first["gen_ai.request.model"], first["gen_ai.usage.input_tokens"]) == (
        "chat", "scripted", 10
    )  # fmt: skip
    stored = json.dumps([span.model_dump(mode="json") for span in spans])
    assert "sk-agent-secret" not in stored and "header-secret" not in stored and "gen_ai.headers" not in stored

    # Read as agl's APO reads them: OpenAI-shaped transcripts, tools included.
    first_call, second_call = TraceToMessages().adapt(spans)
    assert first_call["tools"] == [ROOM_TOOL]
    assert first_call["messages"][0] == {"role": "user", "content": ROOM_REQUEST}
    (tool_call,) = first_call["messages"][-1]["tool_calls"]
    assert tool_call["function"]["name"] == "get_rooms_and_availability"
    assert json.loads(tool_call["function"]["arguments"]) == {"date": "2025-10-13", "time": "10:00", "duration_min": 30}
    assert [m["role"] for m in second_call["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert second_call["messages"][2]["tool_call_id"] == tool_call["id"]
    assert second_call["messages"][-1]["content"].endswith("final_choice: Orion")

    # Training needs the proxy's token ids, and says where they are missing.
    adapted = spans_to_triplets(spans)
    assert adapted.triplets == [] and adapted.report.calls_without_token_ids == 2
    await store.close()


async def test_a_call_to_the_rollout_s_llm_proxy_is_left_to_the_proxy_s_own_span() -> None:
    app = scripted_room_app()
    store = InMemoryLightningStore()
    tracer = Tracer(store)
    proxied, direct = [await store.start_rollout(name) for name in ("proxied", "direct")]
    with serving(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        trace = tracer.trace_context(proxied.rollout_id, proxied.attempt.attempt_id)
        trace.proxied = frozenset({urlsplit(url).netloc})  # as the runner marks the LLM proxy of the rollout
        async with trace:
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": ROOM_REQUEST}])
        async with tracer.trace_context(direct.rollout_id, direct.attempt.attempt_id):
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": ROOM_REQUEST}])
    assert [span.name for span in tracer.get_last_trace()] == ["openai.chat.completion"]
    assert await store.query_spans(proxied.rollout_id) == []
    assert [span.name for span in await store.query_spans(direct.rollout_id)] == ["openai.chat.completion"]
    tracer.shutdown()
    await store.close()


@agl.rollout
async def calculator(task: dict[str, str], llm: agl.LLM) -> None:
    """As agl's calc_x agent: an async client of its own on the `llm` resource's endpoint, the reward emitted."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key="token-abc123", max_retries=0)
    temperature = llm.sampling_parameters.get("temperature", 0.7)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is {task['question']}?"}]
    first = await client.chat.completions.create(model=llm.model, messages=messages, temperature=temperature)
    (call,) = first.choices[0].message.tool_calls or []
    left, right = json.loads(call.function.arguments)["expression"].split("*")  # the calculator tool: a product
    result = str(int(left) * int(right))
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = await client.chat.completions.create(model=llm.model, messages=messages, temperature=temperature)
    agl.emit_reward(1.0 if task["result"] in (answer.choices[0].message.content or "") else 0.0)


async def test_agl_s_calc_x_debug_form_with_the_top_level_names() -> None:
    with serving(scripted_calculator_app()) as url:
        runner = agl.LitAgentRunner[dict[str, str]](agl.OtelTracer())
        store = agl.InMemoryLightningStore()
        resource = agl.LLM(endpoint=f"{url}/v1", model="scripted", sampling_parameters={"temperature": 1.0})
        with runner.run_context(agent=calculator, store=store):
            first = await runner.step({"question": "12 * 15", "result": "180"}, resources={"main_llm": resource})
            second = await runner.step({"question": "16 * 16", "result": "256"}, resources={"main_llm": resource})
    for finished in (first, second):
        spans = await store.query_spans(finished.rollout_id)
        assert [span.name for span in spans] == ["openai.chat.completion", "openai.chat.completion", "lightning.reward"]
        assert spans[0].attributes["gen_ai.request.temperature"] == 1.0
        assert agl.find_final_reward(spans) == 1.0
    await store.close()


# --- apo_debug.py's runner and hook modes, with each of agl's tracer names ---

SKY = "Explain why the sky appears blue using principles of light scattering in 100 words."


def judged_endpoint() -> Any:
    """Answers the agent, then its judge (a number), as a real model would be asked."""
    from support.scripted_agl import scripted_chat_app

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        judging = "Return only a number" in body["messages"][-1]["content"]
        return {"role": "assistant", "content": "0.8" if judging else "Rayleigh scattering."}

    return scripted_chat_app(reply)


@rollout
async def sky_agent(task: str, prompt_template: PromptTemplate) -> float:
    """As apo_debug.py's agent: `AsyncOpenAI()` from the environment, its answer scored by a judging call."""
    client = AsyncOpenAI(max_retries=0)
    messages = [{"role": "user", "content": prompt_template.format(any_question=task)}]
    answer = await client.chat.completions.create(model="gpt-4.1-nano", messages=messages)  # type: ignore[arg-type]
    judge = [
        {"role": "user", "content": f"Task: {task}\nOutput: {answer.choices[0].message.content}\nReturn only a number"}
    ]
    score = await client.chat.completions.create(model="gpt-4.1-nano", messages=judge, temperature=0.0)  # type: ignore[arg-type]
    return float(score.choices[0].message.content or 0)


@pytest.mark.parametrize("tracer_name", ["OtelTracer", "AgentOpsTracer"])
async def test_apo_debug_s_runner_and_hook_modes_with_each_tracer_name(
    tracer_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = judged_endpoint()
    with serving(app) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-agent-secret")
        tracer = getattr(agl, tracer_name)()
        runner = LitAgentRunner[str](tracer)
        store = InMemoryLightningStore()
        resource = PromptTemplate(template="You are a helpful assistant. {any_question}", engine="f-string")
        hook = TraceRecorder()
        with runner.run_context(agent=sky_agent, store=store, hooks=[hook]):  # the hook mode
            finished = await runner.step(SKY, resources={"main_prompt": resource})
        with runner.run_context(agent=sky_agent, store=store):  # the runner mode
            again = await runner.step(SKY, resources={"main_prompt": resource})
    assert app.state.requests[0]["messages"][0]["content"] == f"You are a helpful assistant. {SKY}"
    for done in (finished, again):
        spans = await store.query_spans(done.rollout_id)
        assert [span.name for span in spans] == ["openai.chat.completion", "openai.chat.completion", "lightning.reward"]
        assert find_final_reward(spans) == 0.8
    assert hook.traces == [["openai.chat.completion", "openai.chat.completion", "lightning.reward"]]
    tracer.shutdown()
    await store.close()


# --- apo_debug.py's trainer mode: `Trainer(n_workers=1, initial_resources=...).dev(agent, data)` ---


@pytest.fixture
def prefect_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    monkeypatch.chdir(tmp_path)  # the run's store, MLflow and files go to their defaults there
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_apo_debug_s_trainer_mode_reports_its_rollouts_and_why_no_batch_could_be_built(
    prefect_server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = judged_endpoint()
    with serving(app) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-agent-secret")
        prompt = PromptTemplate(template="You are a helpful assistant. {any_question}", engine="f-string")
        trainer = agl.Trainer(n_workers=1, initial_resources={"main_prompt": prompt})
        report = trainer.dev(sky_agent, [SKY, SKY])  # agl's Baseline only logs; ours reports, and returns

    assert len(app.state.requests) == 2 * 2  # each rollout's answer and its judge, with the agent's own client
    assert report["rollouts"]["rollouts"] == report["rollouts"]["succeeded"] == 2
    assert report["rollouts"]["reward_mean"] == pytest.approx(0.8)
    assert report["agent_errors"] == []
    batch = report["batch"]
    assert batch["rows"] == 0 and batch["batch_path"] is None
    assert "4 LLM calls have no token ids" in batch["no_training_rows"]
    assert "give the client the LLM resource's endpoint" in batch["no_training_rows"]
    # Prefect's run logger said it: in the flow run's logs on the Prefect server, as its UI shows them
    run_log = asyncio.run(flow_run_log_lines("sky_agent-dev"))
    assert any(line.startswith("dev: 2 rollouts (0 failed), reward 0.800, and no training batch: ") for line in run_log)
    assert trainer.config is not None
    assert asyncio.run(reward_values(trainer.config.store_url, f"{trainer.config.run_name}.dev")) == [0.8, 0.8]


async def flow_run_log_lines(name: str) -> list[str]:
    """The messages of the flow runs named `name`, read back from the Prefect server (after sending what is queued:
    Prefect ships run logs in batches, in the background). Not capfd or caplog: Prefect's console handler keeps the
    stderr of the moment it was made (under pytest, maybe an earlier test's capture), and its logging set-up
    replaces the root logger's handlers (caplog's among them)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    await APILogHandler.aflush()
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id for run in runs])))
    return [log.message for log in logs]


async def reward_values(store_url: str, queue: str) -> list[float | None]:
    from lightning.store import SqlLightningStore

    async with SqlLightningStore(store_url, watchdog_interval=None) as store:
        rollouts = await store.query_rollouts(queue=queue)
        return [find_final_reward(await store.query_spans(rollout.rollout_id)) for rollout in rollouts]
