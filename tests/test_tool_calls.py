"""Tool calls on the embedded server: the parser of `<tool_call>` blocks, then a tiny model taught to call the
calculator (tests/support/tool_model.py) generating for real, streamed and not, through the OpenAI SDK, LiteLLM, and
the calculator agent run by a runner through the LLM proxy."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.servers import serving
from support.tool_model import build_calculator_model, calculator_conversations, tool_call_text
from transformers import AutoTokenizer

from examples.calculator.agent import CALCULATOR_TOOL, calculator_agent, load_tasks
from lightning import semconv
from lightning.inference import create_inference_app
from lightning.inference.tools import ToolCall, ToolCallParser, split_tool_calls
from lightning.proxy import LLMProxy
from lightning.runner import Runner
from lightning.store import SqlLightningStore
from lightning.tracing import find_final_reward

TASKS = load_tasks()[:2]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'

# ---- the parser -------------------------------------------------------------------------------------------------


def test_blocks_become_tool_calls_and_the_rest_stays_content() -> None:
    content, calls = split_tool_calls(f"Let me see.\n{CALL}\n{CALL.replace('1 + 2', '3 * 4')} done")
    assert content == "Let me see.\n\n done"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "1 + 2"}),
        ("calculator", {"expression": "3 * 4"}),
    ]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    # Arguments the model wrote as JSON text stay that text.
    [call] = split_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1]
    assert call.function.arguments == '{"a": 1}'
    assert split_tool_calls("no calls") == ("no calls", [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["calculator"]</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',  # never closed
        "ends with <tool_",
    ],
)
def test_what_is_not_a_well_formed_call_stays_content(text: str) -> None:
    assert split_tool_calls(text) == (text, [])


def test_streamed_text_split_anywhere_gives_the_same_calls_and_content() -> None:
    text = f"Sure <tool text {CALL} and <tool_call>oops</tool_call> end"
    whole_content, whole_calls = split_tool_calls(text)
    for size in (1, 2, 3, 7, 11):
        parser = ToolCallParser()
        pieces: list[str | ToolCall] = []
        for start in range(0, len(text), size):
            pieces += parser.feed(text[start : start + size])
        pieces += parser.finish()
        assert "".join(p for p in pieces if isinstance(p, str)) == whole_content
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        assert [c.function for c in calls] == [c.function for c in whole_calls]


def test_a_call_goes_out_as_soon_as_its_block_closes() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == ["Hi "]
    assert parser.feed(CALL[len("<tool") : -3]) == []
    [call] = parser.feed(CALL[-3:])
    assert isinstance(call, ToolCall) and call.function.name == "calculator"
    assert parser.finish() == []


# ---- a model that calls the calculator ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_calculator_model(tmp_path_factory.mktemp("models") / "calculator", TASKS)


@pytest.fixture(scope="module")
def server(taught_model: Path) -> Iterator[str]:
    app = create_inference_app(taught_model, served_model_name="tiny")
    with serving(app) as url:
        yield f"{url}/v1"
    app.state.engine.stop()


def first_turn(task: dict[str, Any]) -> list[dict[str, Any]]:
    return calculator_conversations(task)[0][0]


@pytest.mark.slow
def test_the_model_calls_the_tool_and_the_server_answers_tool_calls(server: str, taught_model: Path) -> None:
    client = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)
    for task in TASKS:
        response = client.chat.completions.create(
            model="tiny",
            messages=first_turn(task),
            tools=[CALCULATOR_TOOL],
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        [choice] = response.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": task["expression"]}
        # The call is what the model generated, not something the server made up.
        generated = (choice.model_extra or {})["token_ids"]
        tokenizer = AutoTokenizer.from_pretrained(taught_model)
        assert tokenizer.decode(generated, skip_special_tokens=True) == tool_call_text(task["expression"])

        # tool_choice "none": the same text, left as content.
        response = client.chat.completions.create(
            model="tiny", messages=first_turn(task), tools=[CALCULATOR_TOOL], tool_choice="none", temperature=0
        )
        assert response.choices[0].message.content == tool_call_text(task["expression"])
        assert response.choices[0].message.tool_calls is None
        assert response.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_a_streamed_tool_call_arrives_whole_in_one_delta(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)
    task = TASKS[0]
    stream = client.chat.completions.create(
        model="tiny", messages=first_turn(task), tools=[CALCULATOR_TOOL], temperature=0, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(d.content or "" for d in deltas) == ""
    [with_calls] = [d for d in deltas if d.tool_calls]
    [call] = with_calls.tool_calls or []
    assert call.index == 0 and call.type == "function" and call.id and call.id.startswith("call_")
    assert call.function is not None and call.function.name == "calculator"
    assert json.loads(call.function.arguments or "") == {"expression": task["expression"]}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
async def test_litellm_gets_the_tool_calls(server: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    task = TASKS[1]
    response = await litellm.acompletion(
        model="openai/tiny",
        api_base=server,
        api_key="unused",
        messages=first_turn(task),
        tools=[CALCULATOR_TOOL],
        temperature=0,
        num_retries=0,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": task["expression"]}


@pytest.mark.slow
async def test_the_calculator_agent_solves_its_tasks_with_real_tool_calls(server: str, tmp_path: Path) -> None:
    """The agent as users run it: a runner, the LLM proxy (advertising `policy` while the server serves `tiny`), and
    the embedded server. The second call of each rollout renders the agent's assistant message with `tool_calls`
    and the tool's reply through the template; the model answers right only if it renders as it was taught."""
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    proxy = LLMProxy(store, [server])
    proxy.start()
    try:
        sampling = {"temperature": 0.0}  # no max_tokens: a call takes 55 tokens, the second prompt 470 of 512
        await store.add_resources({"main_llm": proxy.resource().model_copy(update={"sampling_parameters": sampling})})
        queued = await store.enqueue_many_rollouts([{"input": task} for task in TASKS])
        runner = Runner(calculator_agent, store, idle_wait=0.05)
        assert await runner.iter(max_rollouts=len(TASKS)) == len(TASKS)
        await runner.close()
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in queued], timeout=10)
        assert [r.status for r in finished] == ["succeeded"] * len(TASKS)
        for rollout, task in zip(finished, TASKS, strict=True):
            spans = await store.query_spans(rollout.rollout_id)
            assert find_final_reward(spans) == 1.0
            calls = sorted(
                (s for s in spans if s.attributes.get(semconv.GEN_AI_OPERATION) == "chat"), key=lambda s: s.start_time
            )
            assert [s.attributes[semconv.GEN_AI_FINISH_REASONS] for s in calls] == [["tool_calls"], ["stop"]]
            [asked] = json.loads(calls[0].attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
            assert json.loads(asked["tool_calls"][0]["function"]["arguments"]) == {"expression": task["expression"]}
            assert all(json.loads(s.attributes[semconv.GEN_AI_TOOL_DEFINITIONS]) == [CALCULATOR_TOOL] for s in calls)
            sent_back = json.loads(calls[1].attributes[semconv.GEN_AI_INPUT_MESSAGES])
            assert [m["role"] for m in sent_back] == ["system", "user", "assistant", "tool"]
            assert sent_back[3]["content"] == task["answer"]
            assert all(semconv.LLM_RESPONSE_TOKEN_IDS in s.attributes for s in calls)
    finally:
        proxy.stop()
        await store.close()
