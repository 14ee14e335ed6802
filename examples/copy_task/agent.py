"""Verifiable toy tasks that a tiny model learns in minutes on a CPU: given a few letters, answer with
the last one ("last", a per-token rule, the quickest to learn) or repeat them all ("copy").

A task is `{"letters": "abcd", "target": "d"}`. The agent sends the letters as the user message and
earns, per position, credit for each letter of the target it gives in place; extra output costs
(partial credit gives the policy a gradient long before it is exactly right). It is the demo agent
of training runs on the tiny local model.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp

from lightning.agent import rollout
from lightning.types import LLM, Triplet

ALPHABET = "bdfgjkmp"  # letters the tiny tokenizer never merges: one letter, one token
_TIMEOUT = aiohttp.ClientTimeout(total=60)


@rollout
async def copy_agent(task: dict[str, Any], llm: LLM) -> float:
    # One chat completion, posted as the OpenAI API's JSON with aiohttp. The OpenAI SDK works the same here
    # (examples/first_agent uses it), but on a CPU its request building (~1.2 ms a call) and httpx's client (~0.5 ms
    # more than aiohttp's) cost more than the tiny model takes to answer: they were the largest costs of the demo's
    # rollouts (docs/benchmarks.md, "The rollout stage"). The session is the LLM resource's kept-alive one, shared
    # by the rollouts on this event loop: a session of its own would open a connection per call.
    body = {"model": llm.model, "messages": [{"role": "user", "content": task["letters"]}], **llm.sampling_parameters}
    headers = {"Authorization": f"Bearer {llm.api_key or 'unused'}"}
    url = f"{llm.base_url.rstrip('/')}/chat/completions"
    session = await llm.http_session()
    async with session.post(url, json=body, headers=headers, timeout=_TIMEOUT) as response:
        response.raise_for_status()
        answer = (await response.json())["choices"][0]["message"]["content"] or ""
    return reward(answer, task["target"])


def reward(answer: str, target: str) -> float:
    """The fraction of positions where the answer has the target's letter; extra output costs."""
    answer = answer.strip()
    hits = sum(a == b for a, b in zip(answer, target, strict=False))
    return hits / max(len(target), len(answer))


def make_tasks(count: int, *, kind: str = "last", length: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """`count` distinct tasks of `length` letters from ALPHABET, reproducible by seed."""
    if kind not in ("last", "copy"):
        raise ValueError(f"kind must be 'last' or 'copy', not {kind!r}")
    if count > len(ALPHABET) ** length:
        raise ValueError(f"only {len(ALPHABET) ** length} distinct tasks of {length} letters; ask for fewer")
    rng = random.Random(seed)
    seen: set[str] = set()
    tasks = []
    while len(tasks) < count:
        letters = "".join(rng.choice(ALPHABET) for _ in range(length))
        if letters not in seen:
            seen.add(letters)
            tasks.append({"letters": letters, "target": letters[-1] if kind == "last" else letters})
    return tasks


def demonstrations(tokenizer: Any, tasks: list[dict[str, Any]]) -> list[Triplet]:
    """The right answers as triplets (prompt ids as the chat template renders them, the letters and the
    end-of-turn token as the response), for a supervised warm start."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    triplets = []
    for index, task in enumerate(tasks):
        messages = [{"role": "user", "content": task["letters"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        response = tokenizer.encode(task["target"], add_special_tokens=False) + [end]
        triplets.append(Triplet(prompt=prompt, response=response, reward=1.0, metadata={"group_id": f"demo-{index}"}))
    return triplets
