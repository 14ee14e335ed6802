"""End to end on real parts: runner -> agent -> LLM proxy -> embedded inference server serving the tiny
local model, with spans in a SQLite store. The token ids the store holds for each call must be the
ones the server generated, streaming or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.servers import serving

from examples.calculator.agent import calculator_agent, load_tasks
from lightning import semconv
from lightning.agent import rollout
from lightning.inference import create_inference_app
from lightning.models import build_tiny_model
from lightning.proxy import LLMProxy
from lightning.runner import Runner
from lightning.store import SqlLightningStore
from lightning.types import LLM, Span

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def inference(tiny_model: Path) -> Iterator[tuple[Any, str]]:
    app = create_inference_app(tiny_model, served_model_name="tiny")
    with serving(app) as url:
        yield app, f"{url}/v1"
    app.state.engine.stop()


@rollout
async def streaming_agent(task: dict[str, Any], llm: LLM) -> float:
    """Asks once, streaming, and earns 1.0 for any non-empty answer."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    stream = await client.chat.completions.create(
        model=llm.model, messages=messages, stream=True, **llm.sampling_parameters
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    return 1.0 if text else 0.0


def llm_spans(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.attributes.get(semconv.GEN_AI_OPERATION) == "chat"]


@pytest.mark.parametrize("reach", ["http", "in-process"])
@pytest.mark.parametrize("agent", [calculator_agent, streaming_agent], ids=["calculator", "streaming"])
async def test_the_store_holds_exactly_the_tokens_the_server_generated(
    tmp_path: Path, inference: tuple[Any, str], agent: Any, reach: str
) -> None:
    """Over HTTP, or handed to the server's app in the proxy's process (`in_process`, as when one process serves
    both): the calculator agent's calls continue its earlier ones token-exactly (the server's token-in route)."""
    app, server_url = inference
    engine = app.state.engine
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    in_process = {server_url: app} if reach == "in-process" else None
    proxy = LLMProxy(store, [server_url], model_name="tiny", in_process=in_process)
    proxy.start()
    try:
        sampling = {"temperature": 1.0, "max_tokens": 12}
        await store.add_resources({"main_llm": proxy.resource().model_copy(update={"sampling_parameters": sampling})})
        tasks = load_tasks()[:4]
        queued = await store.enqueue_many_rollouts([{"input": task} for task in tasks])
        runner = Runner(agent, store, idle_wait=0.05)
        assert await runner.iter(max_rollouts=len(tasks)) == len(tasks)
        await runner.close()
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in queued], timeout=10)
        assert [r.status for r in finished] == ["succeeded"] * len(tasks)

        generated = {record.request_id: record for record in engine.recent}
        checked = 0
        for rollout_ in finished:
            spans = llm_spans(await store.query_spans(rollout_.rollout_id))
            assert spans, f"rollout {rollout_.rollout_id} left no LLM call span"
            for span in spans:
                record = generated[span.attributes[semconv.GEN_AI_RESPONSE_ID]]
                prompt = semconv.decode_token_ids(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
                responses = [semconv.decode_token_ids(s) for s in span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
                assert prompt == record.prompt_token_ids
                assert responses == record.output_token_ids
                assert span.attributes[semconv.GEN_AI_OUTPUT_TOKENS] == len(responses[0])
                assert span.attributes[semconv.LLM_STREAM] is (agent is streaming_agent)
                checked += 1
        assert checked >= len(tasks)
        assert (proxy._client is None) is (reach == "in-process")  # no HTTP client was ever needed
    finally:
        proxy.stop()
        await store.close()
