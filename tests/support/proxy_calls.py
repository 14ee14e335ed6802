"""What the LLM proxy's tests share: the proxy served on a thread, an attempt and its LLM, an OpenAI client on it,
and the token ids a span holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai

from lightning import semconv
from lightning.proxy import LLMProxy
from lightning.store import SqlLightningStore
from lightning.types import LLM, AttemptedRollout, Span

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@contextlib.contextmanager
def running(proxy: LLMProxy) -> Iterator[LLMProxy]:
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


async def attempt_llm(store: SqlLightningStore, proxy: LLMProxy) -> tuple[AttemptedRollout, LLM]:
    rollout = await store.start_rollout({"question": "2+2"})
    return rollout, proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)


def client(llm: LLM) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0)


def token_ids(span: Span) -> tuple[list[int], list[list[int]]]:
    prompt = semconv.decode_token_ids(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
    responses = [semconv.decode_token_ids(s) for s in span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
    return prompt, responses
