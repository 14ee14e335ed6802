"""An agent written for agent-lightning 0.3, with only its imports changed (`import agentlightning as agl` ->
`import lightning as agl`): a LitAgent subclass with `trained_agents`, the `main_llm` resource, `self.tracer`,
a dict of rewards emitted with keywords, and a bool returned as the reward."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

import lightning as agl


class LetterAgent(agl.LitAgent[dict[str, Any]]):
    def __init__(self, trained_agents: str | None = r"answer") -> None:
        super().__init__(trained_agents=trained_agents)

    async def rollout_async(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> bool:
        llm: agl.LLM = resources["main_llm"]  # type: ignore[assignment]
        handler = self.tracer.get_langchain_handler()  # agent-lightning agents hand this to LangChain
        assert handler is None or callable(handler)
        client = AsyncOpenAI(
            base_url=llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),  # type: ignore[attr-defined]
            api_key=llm.api_key or "dummy",
            max_retries=0,
        )
        response = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"First letter of {task['word']}?"}],
            **llm.sampling_parameters,
        )
        answer = (response.choices[0].message.content or "").strip()
        correct = answer == task["word"][0]
        agl.emit_reward(
            {"correct": correct, "short": len(answer) <= 2},
            primary_key="correct",
            attributes={"answer_chars": len(answer)},
        )
        return correct


def letter_tasks() -> list[dict[str, Any]]:
    return [{"word": word} for word in ("apple", "bread", "chair", "dog", "egg", "fig", "goat", "hat")]
