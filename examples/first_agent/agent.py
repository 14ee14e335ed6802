"""The README's first agent: ask the model for the first letter of a word; reward 1.0 for that letter alone."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from lightning.agent import rollout
from lightning.types import LLM


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
