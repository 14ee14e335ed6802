"""The embedded inference server: the tiny model served over real HTTP, called with the openai SDK and httpx."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from support.servers import serving
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.inference import create_inference_app
from lightning.inference.__main__ import main as inference_main
from lightning.inference.engine import InferenceEngine, SamplingParams
from lightning.models import build_tiny_model

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("inference") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(base URL, app) of one server for the module; tests that change weights start their own."""
    app = create_inference_app(model_dir, served_model_name="tiny", max_batch_size=8)
    with serving(app) as base_url:
        yield base_url, app


@pytest.fixture(scope="module")
def client(server: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def engine(server: tuple[str, Any]) -> Any:
    return server[1].state.engine


def extra(obj: Any, name: str) -> Any:
    """A field the openai SDK does not declare (vLLM's token ids), or None."""
    return (obj.model_extra or {}).get(name)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy(model: Any, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-softmax, by full forward passes without any cache."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    with torch.inference_mode():
        for _ in range(steps):
            step = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            tokens.append(int(step.argmax()))
            logprobs.append(step)
            ids.append(tokens[-1])
    return tokens, logprobs


def test_chat_returns_token_ids_where_vllm_does(client: openai.OpenAI, engine: Any, tokenizer: Any) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt_ids = extra(response, "prompt_token_ids")
    token_ids = extra(response.choices[0], "token_ids")
    assert prompt_ids == chat_prompt_ids(tokenizer, MESSAGES)
    assert 1 <= len(token_ids) <= 8
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == response.choices[0].message.content
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == "tiny"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(token_ids)
    assert response.usage.total_tokens == len(prompt_ids) + len(token_ids)
    record = next(r for r in engine.recent if r.request_id == response.id)
    assert record.prompt_token_ids == prompt_ids
    assert record.output_token_ids == [token_ids]


def test_completions_with_text_and_token_prompts(client: openai.OpenAI, engine: Any, tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    by_text = client.completions.create(
        model="tiny", prompt="The answer is", max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    by_ids = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    for response in (by_text, by_ids):
        choice = response.choices[0]
        assert response.id.startswith("cmpl-")
        assert response.object == "text_completion"
        assert extra(choice, "prompt_token_ids") == prompt_ids
        assert tokenizer.decode(extra(choice, "token_ids"), skip_special_tokens=True) == choice.text
        record = next(r for r in engine.recent if r.request_id == response.id)
        assert record.output_token_ids == [extra(choice, "token_ids")]
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert extra(by_text, "prompt_token_ids") is None


def test_greedy_is_argmax(client: openai.OpenAI, tokenizer: Any, model: Any) -> None:
    prompt_ids = tokenizer.encode("1 + 1 =", add_special_tokens=False)
    response = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    token_ids = extra(response.choices[0], "token_ids")
    expected, _ = greedy(model, prompt_ids, len(token_ids))
    assert token_ids == expected


def test_chat_stream_matches_non_stream(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7)
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
        )
    )
    assert extra(chunks[0], "prompt_token_ids") == chat_prompt_ids(tokenizer, MESSAGES)
    assert all(extra(chunk, "prompt_token_ids") is None for chunk in chunks[1:])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert chunks[0].object == "chat.completion.chunk"
    choice_chunks = [chunk.choices[0] for chunk in chunks if chunk.choices]
    streamed_ids = [token for choice in choice_chunks for token in extra(choice, "token_ids") or []]
    assert streamed_ids == extra(whole.choices[0], "token_ids")
    assert "".join(choice.delta.content or "" for choice in choice_chunks) == whole.choices[0].message.content
    assert choice_chunks[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(streamed_ids)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stream_n2(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    whole = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"return_token_ids": True}))
    for index in range(2):
        choices = [c for chunk in chunks for c in chunk.choices if c.index == index]
        assert extra(choices[0], "prompt_token_ids") == extra(whole.choices[index], "prompt_token_ids")
        assert all(extra(choice, "prompt_token_ids") is None for choice in choices[1:])
        assert [t for choice in choices for t in extra(choice, "token_ids")] == extra(whole.choices[index], "token_ids")
        assert "".join(choice.text for choice in choices) == whole.choices[index].text
        assert choices[-1].finish_reason == whole.choices[index].finish_reason


def test_seed_gives_the_same_output(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[int]:
        response = client.completions.create(
            model="tiny",
            prompt="Once",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        return extra(response.choices[0], "token_ids")

    assert sample(1) == sample(1)
    assert len({tuple(sample(seed)) for seed in (1, 2, 3)}) > 1


def test_n_choices(client: openai.OpenAI, engine: Any, tokenizer: Any) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, n=3, seed=0, extra_body={"return_token_ids": True}
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    token_ids = [extra(choice, "token_ids") for choice in response.choices]
    assert len({tuple(ids) for ids in token_ids}) > 1
    assert response.usage.completion_tokens == sum(len(ids) for ids in token_ids)
    assert response.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    record = next(r for r in engine.recent if r.request_id == response.id)
    assert record.output_token_ids == token_ids


def test_stop_strings(client: openai.OpenAI, tokenizer: Any) -> None:
    base = dict(model="tiny", prompt="The answer is", max_tokens=24, temperature=0)
    free = client.completions.create(**base, extra_body={"return_token_ids": True})
    text, free_ids = free.choices[0].text, extra(free.choices[0], "token_ids")
    # A stop string from the middle of the greedy text: two printable ASCII characters.
    start = next(i for i in range(2, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
    stop = text[start : start + 2]
    cut = text.index(stop)
    stopped = client.completions.create(**base, stop=[stop, "never appears"], extra_body={"return_token_ids": True})
    choice = stopped.choices[0]
    assert choice.text == text[:cut]
    assert choice.finish_reason == "stop"
    stop_ids = extra(choice, "token_ids")
    # The tokens up to and including the one that completed the stop string.
    assert stop_ids == free_ids[: len(stop_ids)]
    assert stop in tokenizer.decode(stop_ids)
    assert stop not in tokenizer.decode(stop_ids[:-1])
    streamed = client.completions.create(**base, stop=stop, stream=True)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == text[:cut]


def test_chat_logprobs_match_a_forward_pass(client: openai.OpenAI, tokenizer: Any, model: Any) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    token_ids = extra(response.choices[0], "token_ids")
    _, expected = greedy(model, chat_prompt_ids(tokenizer, MESSAGES), len(token_ids))
    content = response.choices[0].logprobs.content
    assert len(content) == len(token_ids)
    for entry, token, step in zip(content, token_ids, expected, strict=True):
        assert entry.token == tokenizer.decode([token])
        assert abs(entry.logprob - step[token].item()) < 1e-4
        assert len(entry.top_logprobs) == 3
        top_values = step.topk(3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values, abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy takes the top token
        assert isinstance(entry.bytes, list)


def test_completion_logprobs_match_a_forward_pass(client: openai.OpenAI, tokenizer: Any, model: Any) -> None:
    prompt_ids = tokenizer.encode("Hello, world", add_special_tokens=False)
    response = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=5, temperature=0, logprobs=2, extra_body={"return_token_ids": True}
    )
    token_ids = extra(response.choices[0], "token_ids")
    _, expected = greedy(model, prompt_ids, len(token_ids))
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([token]) for token in token_ids]
    for value, token, step in zip(logprobs.token_logprobs, token_ids, expected, strict=True):
        assert abs(value - step[token].item()) < 1e-4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


async def test_concurrent_requests_are_batched(server: tuple[str, Any], engine: Any) -> None:
    steps_before = engine.steps_run
    engine.max_rows_seen = 0
    async with openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0) as client:
        responses = await asyncio.gather(
            *[
                client.completions.create(model="tiny", prompt=f"Question {i}:", max_tokens=24, temperature=0)
                for i in range(8)
            ]
        )
    generated = sum(response.usage.completion_tokens for response in responses)
    steps = engine.steps_run - steps_before
    assert engine.max_rows_seen >= 4
    # Run one at a time, each token would cost one decode step.
    assert steps < generated / 2


def test_unknown_fields_are_accepted_and_tools_reach_the_template(client: openai.OpenAI, tokenizer: Any) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        tools=tools,
        tool_choice="auto",
        user="someone",
        extra_body={"return_token_ids": True, "some_vendor_field": 1},
    )
    assert extra(response, "prompt_token_ids") == chat_prompt_ids(tokenizer, MESSAGES, tools=tools)


def test_refusals_say_what_is_supported(server: tuple[str, Any], client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r'response_format.*\{"type": "text"\}'):
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="tool_choice.*'auto'.*'none'"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    # What the server does honour is accepted.
    for extra_fields in ({"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}):
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **extra_fields)
        assert response.choices[0].message.tool_calls is None


def test_an_agents_tool_call_turn_renders_through_the_chat_template(client: openai.OpenAI, tokenizer: Any) -> None:
    """What a tool-using agent sends back (the SDK's assistant message dumped, then the tool's reply) is rendered by
    the template with the call in it, exactly as the tokenizer renders it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2 + 2"}'}}
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "4"})
    response = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=2, extra_body={"return_token_ids": True}
    )
    prompt_ids = extra(response, "prompt_token_ids")
    assert prompt_ids == chat_prompt_ids(tokenizer, messages, tools=TOOLS)
    text = tokenizer.decode(prompt_ids)
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"x": "2 + 2"}}</tool_call><|im_end|>' in text
    )
    assert "<|im_start|>tool\n4<|im_end|>" in text


def test_models_and_health(server: tuple[str, Any], client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server[0]}/health").status_code == 200


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("chat/completions", {"model": "tiny"}, 400, "messages"),
        ("chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
        ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ("chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
        ("chat/completions", {"messages": MESSAGES, "n": 0}, 400, "n"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 100_000}, 400, "max_tokens"),
        ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ("chat/completions", {"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
        (
            "chat/completions",
            {"messages": MESSAGES, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        ("chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, 400, "tool_choice"),
        ("chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
        (
            "chat/completions",
            {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "calc"}}},
            400,
            "tool_choice",
        ),
        ("completions", {"prompt": [5] * 600}, 400, "prompt"),
        ("completions", {"prompt": [10**6]}, 400, "prompt"),
        ("completions", {"prompt": ""}, 400, "prompt"),
        ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("completions", {}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: tuple[str, Any], route: str, body: dict[str, Any], status: int, param: str
) -> None:
    response = httpx.post(f"{server[0]}/v1/{route}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert param.split(".")[0] in error["message"]


def test_invalid_json_and_sdk_errors(server: tuple[str, Any], client: openai.OpenAI) -> None:
    response = httpx.post(
        f"{server[0]}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-0.5)


def test_reload_swaps_weights_and_version(model_dir: Path, tmp_path: Path, tokenizer: Any) -> None:
    other_dir = build_tiny_model(tmp_path / "other", seed=1)
    other_model = AutoModelForCausalLM.from_pretrained(other_dir).eval()
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    app = create_inference_app(model_dir)
    engine = app.state.engine
    with serving(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

        def generate() -> list[int]:
            response = client.completions.create(
                prompt=prompt_ids, model="tiny", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
            )
            return extra(response.choices[0], "token_ids")

        before = generate()
        served = {
            "version": 0, "path": str(model_dir), "base_model": str(Path(model_dir).resolve()), "device": "cpu",
            "dtype": "float32",
        }  # fmt: skip
        assert httpx.get(f"{base_url}/admin/version").json() == served
        reloaded = httpx.post(f"{base_url}/admin/reload", json={"path": str(other_dir), "version": 7})
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json() == {"version": 7, "path": str(other_dir)}
        assert httpx.get(f"{base_url}/admin/version").json()["version"] == 7
        after = generate()
        assert after != before
        assert after == greedy(other_model, prompt_ids, len(after))[0]
        assert engine.recent[-1].model_version == 7
        assert httpx.post(f"{base_url}/admin/reload", json={"path": str(model_dir)}).json()["version"] == 2
        assert generate() == before
        missing = httpx.post(f"{base_url}/admin/reload", json={"path": str(tmp_path / "missing")})
        assert missing.status_code == 400
        assert missing.json()["error"]["param"] == "path"


def test_api_key_is_required_except_for_health(model_dir: Path) -> None:
    app = create_inference_app(model_dir, served_model_name="tiny", api_key="secret")
    with serving(app) as base_url:
        assert httpx.get(f"{base_url}/health").status_code == 200
        guarded = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/admin/version"), ("GET", "/docs")]
        for method, path in [*guarded, ("GET", "/openapi.json"), ("POST", "/admin/reload")]:
            response = httpx.request(method, f"{base_url}{path}", json={"prompt": "x"})
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "AuthenticationError"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="secret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason


async def test_lifespan_starts_and_stops_the_engine(model_dir: Path) -> None:
    app = create_inference_app(model_dir, served_model_name="tiny")
    async with app.router.lifespan_context(app):
        assert app.state.engine._thread.is_alive()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 200
    assert not app.state.engine._thread.is_alive()


async def test_reload_waits_for_the_running_batch(model_dir: Path, tmp_path: Path, tokenizer: Any, model: Any) -> None:
    other_dir = build_tiny_model(tmp_path / "other", seed=1)
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    app = create_inference_app(model_dir, served_model_name="tiny")
    with serving(app) as base_url:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
            stream = await client.completions.create(
                model="tiny",
                prompt=prompt_ids,
                max_tokens=100,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            token_ids = []
            reload = None
            async for chunk in stream:
                token_ids += extra(chunk.choices[0], "token_ids")
                if reload is None:  # the request is decoding now: reload in the middle of its batch
                    reload = asyncio.create_task(
                        asyncio.to_thread(httpx.post, f"{base_url}/admin/reload", json={"path": str(other_dir)})
                    )
            assert (await reload).json()["version"] == 1
    assert token_ids == greedy(model, prompt_ids, len(token_ids))[0]
    assert app.state.engine.recent[-1].model_version == 0


def test_top_p_near_zero_is_greedy(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Once upon", max_tokens=8, extra_body={"return_token_ids": True})
    greedy_ids = extra(client.completions.create(**kwargs, temperature=0).choices[0], "token_ids")
    nucleus = client.completions.create(**kwargs, temperature=1.0, top_p=1e-6, seed=5)
    assert extra(nucleus.choices[0], "token_ids") == greedy_ids


def test_generation_errors_are_500s_in_openai_shape(
    server: tuple[str, Any], engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_sample(logits: torch.Tensor, row: Any) -> int:
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(engine, "_sample", broken_sample)
    response = httpx.post(f"{server[0]}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert "sampler exploded" in response.json()["error"]["message"]
    with httpx.stream("POST", f"{server[0]}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert "sampler exploded" in events[-1]
    monkeypatch.undo()
    assert httpx.post(f"{server[0]}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_cli_refuses_a_public_host_without_api_key(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        inference_main(["--model", str(model_dir), "--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    assert "--api-key" in capsys.readouterr().err


def test_the_lightning_command_serves_inference_too(model_dir: Path) -> None:
    """`lightning inference serve` is `python -m lightning.inference`: the same options, the same refusal."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning.cli", "inference", "serve", "--model", str(model_dir), "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--api-key" in done.stderr, done.stderr


async def _sampled(engine: Any, prompts: list[list[int]], seed: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's sampled tokens and their log-probs, all requests sent at once (so they share batches)."""

    async def one(index: int, prompt: list[int]) -> tuple[list[int], list[float]]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed + index, logprobs=0)
        tokens, logprobs = [], []
        async for output in engine.generate(f"r{index}", prompt, params):
            tokens += output.token_ids
            logprobs += [item.logprob for item in output.logprobs]
        return tokens, logprobs

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def test_batch_invariant_engine_gives_a_sequence_the_same_numbers_whatever_shares_its_batch(
    model_dir: Path, tokenizer: Any
) -> None:
    """`deterministic: true`'s engine: a seeded request samples the same tokens with bit-identical log-probs alone
    and beside requests of other lengths (which, batched together, pad and reshape every matrix product)."""
    target = tokenizer.encode("Copy these letters: bdfg", add_special_tokens=False)
    others = [tokenizer.encode("x" * n, add_special_tokens=False) for n in (1, 7, 19, 33)]
    engine = InferenceEngine(model_dir, device="cpu", max_batch_size=8, batch_invariant=True)
    try:
        alone = (await _sampled(engine, [target], seed=5))[0]
        crowded = (await _sampled(engine, [target, *others], seed=5))[0]
        assert engine.max_rows_seen == 1  # every forward pass a batch of one
    finally:
        engine.stop()
    assert crowded == alone


def test_the_served_dtype_is_a_setting_and_the_server_says_which(model_dir: Path, tmp_path: Path) -> None:
    """auto holds the weights in float32 on a CPU (bfloat16 on a GPU); an explicit dtype holds them in that, whatever
    the checkpoint's, through reloads too; /admin/version says which."""
    assert InferenceEngine(model_dir).dtype == torch.float32
    app = create_inference_app(model_dir, dtype="bfloat16", device="cpu")
    engine = app.state.engine
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    with serving(app) as base_url:
        assert httpx.get(f"{base_url}/admin/version").json()["dtype"] == "bfloat16"
        other_dir = build_tiny_model(tmp_path / "other", seed=1)
        assert httpx.post(f"{base_url}/admin/reload", json={"path": str(other_dir)}).status_code == 200
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        answer = httpx.post(f"{base_url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).json()
        assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_the_server_process_keeps_idle_connections_and_logs_no_line_per_call(model_dir: Path, tmp_path: Path) -> None:
    """The LLM proxy's pooled connections outlive the pause between rollout phases (uvicorn's default, 5 s, closed
    them: each phase opened new ones, and a call on one closed under it was retried), and a call costs no log line
    (5-6% of the server's CPU in the rollout path's profile)."""
    import http.client
    import time

    from prefect_server import start_logged, stop_process_group, tail
    from support.servers import free_port

    port = free_port()
    log = tmp_path / "inference.log"
    command = [sys.executable, "-m", "lightning.inference", "--model", str(model_dir), "--port", str(port)]
    process = start_logged(command, log)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, tail(log)
            if "Uvicorn running" in log.read_text():
                break
            time.sleep(0.2)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for pause in (0, 6.5):  # past uvicorn's 5 s default
            time.sleep(pause)
            connection.request("GET", "/v1/models")
            answer = connection.getresponse()
            assert answer.status == 200 and answer.read()
            if not pause:
                first_socket = connection.sock
        assert connection.sock is first_socket  # the same connection, still open
        connection.close()
    finally:
        stop_process_group(process)
    assert '"GET /v1/models' not in log.read_text(), tail(log)


def test_a_chat_prompt_asked_again_is_rendered_once_and_each_caller_gets_its_own_ids(
    engine: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO asks for each task's prompt several times: the server renders the chat template once per distinct
    prompt (messages, tools, add_generation_prompt), for the last `size` of them."""
    from lightning.inference import server as server_module
    from lightning.inference.server import ChatCompletionRequest, PromptIds

    rendered: list[Any] = []
    render = server_module.chat_prompt_token_ids
    monkeypatch.setattr(server_module, "chat_prompt_token_ids", lambda *args: rendered.append(args[1]) or render(*args))
    prompt_ids = PromptIds(engine, size=2)

    def ask(content: str, **fields: Any) -> list[int]:
        return prompt_ids(ChatCompletionRequest(messages=[{"role": "user", "content": content}], **fields))

    first = ask("bdfg")
    assert first == chat_prompt_ids(tokenizer, [{"role": "user", "content": "bdfg"}])
    first.append(0)  # the caller's own list: the kept ids stay as they were
    assert ask("bdfg") == chat_prompt_ids(tokenizer, [{"role": "user", "content": "bdfg"}]) and len(rendered) == 1
    assert ask("bdfg", tools=TOOLS) == chat_prompt_ids(tokenizer, [{"role": "user", "content": "bdfg"}], tools=TOOLS)
    assert len(rendered) == 2  # the tools are part of the prompt
    ask("kmpb")  # a third distinct prompt: the least recently asked (plain "bdfg") is dropped
    ask("bdfg")
    assert len(rendered) == 4
