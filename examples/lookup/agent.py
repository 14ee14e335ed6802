"""A multi-turn, tool-calling agent: it answers the value of a key that only its `lookup` tool knows.

A task is `{"key": "d", "table": 17, "value": "k", "calls": 1}`: a key, and which of many tables the tool reads
(say, a user's own records). The model sees only the key, so it cannot know the value: it earns its reward only by
calling `lookup` (OpenAI's `tools` and `tool_calls`), reading the result and answering with it. In some tables a
key points to another key (`next f`), so its task needs two tool calls. Reward 1.0 for the right value, else 0.0.

The tool runs in the agent's process, as a user's tool would. Each rollout keeps one HTTP session for its turns.
"""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp

from lightning.agent import rollout
from lightning.chat import continue_conversation
from lightning.types import LLM, Triplet

ALPHABET = "bdfgjkmp"  # letters the tiny tokenizer never merges: one letter, one token
KEYS = list(ALPHABET)
"""A table's keys: one letter each, so a key is one token to copy (two-letter keys are a harder task the tiny model
learns far more slowly: docs/benchmarks.md, "Multi-turn")."""
MAX_TURNS = 4
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value of a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
_TIMEOUT = aiohttp.ClientTimeout(total=120)


def table(number: int) -> dict[str, str]:
    """Table `number`: every key's entry, a value letter, or for a third of the keys `next <key>` naming a key that
    has a value. The same number gives the same table."""
    rng = random.Random(number)
    keys = list(KEYS)
    rng.shuffle(keys)
    third = round(len(keys) / 3)
    pointers, direct = keys[:third], keys[third:]
    entries = {key: rng.choice(ALPHABET) for key in direct}
    for key in pointers:
        entries[key] = f"next {rng.choice(direct)}"
    return entries


def run_tool(entries: dict[str, str], name: str, arguments: str) -> str:
    """A tool call's result as the model reads it; a malformed call is told to the model, never raised."""
    if name != "lookup":
        return f"error: no tool {name!r}"
    try:
        key = json.loads(arguments)["key"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return 'error: give {"key": "<a letter>"}'
    return entries.get(str(key).strip(), f"no key {key!r}")


@rollout
async def lookup_agent(task: dict[str, Any], llm: LLM) -> float:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["key"]}]
    headers = {"Authorization": f"Bearer {llm.api_key or 'unused'}"}
    url = f"{llm.base_url.rstrip('/')}/chat/completions"
    entries = table(task["table"])
    answer = ""
    session = await llm.http_session()  # kept alive across rollouts: no new connection a call
    for _ in range(MAX_TURNS):
        body = {"model": llm.model, "messages": messages, "tools": [LOOKUP_TOOL], **llm.sampling_parameters}
        async with session.post(url, json=body, headers=headers, timeout=_TIMEOUT) as response:
            response.raise_for_status()
            choice = (await response.json())["choices"][0]
        message = choice["message"]
        if choice.get("finish_reason") == "length":
            break  # cut off at max_tokens: a reply that ran on is no answer, and a cut tool call no call
        if not message.get("tool_calls"):
            answer = message.get("content") or ""
            break
        messages.append(message)
        for call in message["tool_calls"]:
            result = run_tool(entries, call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 1.0 if answer.strip() == task["value"] else 0.0


def make_tasks(count: int, *, first_table: int = 0, seed: int = 0, balanced_keys: bool = False) -> list[dict[str, Any]]:
    """`count` tasks, task i asking a random key of table `first_table + i` (reproducible by `seed`).
    `balanced_keys`: the keys drawn in shuffled rounds of all eight, so every letter is asked equally often."""
    rng = random.Random(seed)
    tasks = []
    keys: list[str] = []
    for number in range(first_table, first_table + count):
        if not balanced_keys:
            key = rng.choice(KEYS)
        else:
            keys = keys or rng.sample(KEYS, len(KEYS))
            key = keys.pop()
        entries = table(number)
        entry, calls = entries[key], 1
        if entry.startswith("next "):
            entry, calls = entries[entry.removeprefix("next ")], 2
        tasks.append({"key": key, "table": number, "value": entry, "calls": calls})
    return tasks


def demonstrations(tokenizer: Any, tasks: list[dict[str, Any]], follow_share: float = 1.0) -> list[Triplet]:
    """Demonstrated conversations as trajectory rows for a supervised warm start: the first prompt as the chat
    template renders it, then each assistant turn (trained: mask 1) and what the template puts between turns (the
    tool's result and the next turn's header: mask 0), token for token as the proxy stitches a live conversation.

    `follow_share`: in that share of the two-call tasks (spread evenly, by tenths) the demonstrator follows the
    pointer; in the others it answers at once with the letter the pointer names, as a hasty agent would (reward 0)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    triplets = []
    pointers = 0  # two-call tasks so far
    for index, task in enumerate(tasks):
        hasty = task["calls"] == 2 and pointers % 10 >= round(follow_share * 10)
        pointers += task["calls"] == 2
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["key"]}]
        text = tokenizer.apply_chat_template(messages, tools=[LOOKUP_TOOL], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        response: list[int] = []
        mask: list[int] = []
        key, entries = task["key"], table(task["table"])
        while True:
            entry = entries[key]
            call = {"name": "lookup", "arguments": {"key": key}}
            turn = tokenizer.encode(f"<tool_call>{json.dumps(call)}</tool_call>", add_special_tokens=False) + [end]
            assistant = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"call_{len(messages)}", "type": "function",
                     "function": {"name": "lookup", "arguments": json.dumps({"key": key})}},
                ],
            }  # fmt: skip
            tool = {"role": "tool", "tool_call_id": f"call_{len(messages)}", "content": entry}
            bridge = continue_conversation(tokenizer, messages + [assistant], [tool], tools=[LOOKUP_TOOL], last=end)
            response += turn + bridge
            mask += [1] * len(turn) + [0] * len(bridge)
            messages += [assistant, tool]
            if not entry.startswith("next "):
                break
            key = entry.removeprefix("next ")
            if hasty:
                break
        value = key if hasty else task["value"]
        answer = tokenizer.encode(value, add_special_tokens=False) + [end]
        response += answer
        mask += [1] * len(answer)
        reward = 1.0 if value == task["value"] else 0.0
        metadata = {"group_id": f"demo-{index}"}
        triplets.append(Triplet(prompt=prompt, response=response, reward=reward, response_mask=mask, metadata=metadata))
    return triplets


HASTY_FOLLOW_SHARE = 0.2


def hasty_demonstrations(tokenizer: Any, tasks: list[dict[str, Any]]) -> list[Triplet]:
    """`make lookup`'s warm start: a hasty demonstrator's conversations. It always looks the key up and answers
    one-call tasks right, but follows a pointer in only 2 of 10 two-call tasks; in the others it answers the letter
    the pointer names. So the warm-started agent follows pointers about as rarely, and RL has to learn to follow them
    all: to do better than its demonstrations, as demonstrations from logs or a weaker model leave it to do."""
    return demonstrations(tokenizer, tasks, follow_share=HASTY_FOLLOW_SHARE)
