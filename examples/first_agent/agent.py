"""The README's first agent: ask the model for the first letter of a word; reward 1.0 for that letter alone."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from lightning.agent import rollout
from lightning.types import LLM, Triplet


@rollout
async def first_letter(task: dict[str, Any], llm: LLM) -> float:
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused")
    response = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"First letter of {task['word']}?"}],
        **llm.sampling_parameters,
    )
    answer = (response.choices[0].message.content or "").strip()
    return 1.0 if answer == task["word"][0] else 0.0


def demonstrations(tokenizer: Any, tasks: list[dict[str, Any]]) -> list[Triplet]:
    """The right answers, for a supervised warm start (`warm_start` in config.yaml): each task's prompt as the chat
    template renders it, and the answer with the template's end of turn as the response."""
    rows = []
    for index, task in enumerate(tasks):
        question = [{"role": "user", "content": f"First letter of {task['word']}?"}]
        asked = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
        answered = question + [{"role": "assistant", "content": task["word"][0]}]
        whole = tokenizer.apply_chat_template(answered, tokenize=False)
        prompt = tokenizer.encode(asked, add_special_tokens=False)
        response = tokenizer.encode(whole[len(asked) :].rstrip(), add_special_tokens=False)
        rows.append(Triplet(prompt=prompt, response=response, reward=1.0, metadata={"group_id": f"demo-{index}"}))
    return rows
