"""A tiny model taught to call the calculator: a random model almost never writes a well-formed `<tool_call>` block,
so a few hundred supervised steps on the calculator agent's own conversations make it answer them word for word
(greedy). What it then generates is real generation by the embedded server, through its real parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.calculator.agent import CALCULATOR_TOOL, SYSTEM_PROMPT
from lightning.models import build_tiny_model
from lightning.models.files import no_progress_bars
from lightning.models.tiny import IM_END


def tool_call_text(expression: str) -> str:
    """What the tiny model's chat template asks the model to write to call the calculator."""
    return f'<tool_call>{{"name": "calculator", "arguments": {json.dumps({"expression": expression})}}}</tool_call>'


def calculator_conversations(task: dict[str, Any]) -> list[tuple[list[dict[str, Any]], str]]:
    """The two turns of the calculator agent on `task`, as (messages sent, answer to learn): first the tool call,
    then, after the tool's result, the number. The messages have the shape the agent sends back (the assistant's
    message dumped from the SDK, arguments as JSON text; the tool's reply)."""
    first = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    call = {
        "id": "call_any",  # the template does not render ids: any id gives the same prompt
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": task["expression"]})},
    }
    second = [*first, {"role": "assistant", "tool_calls": [call]}]
    second.append({"role": "tool", "tool_call_id": "call_any", "content": task["answer"]})
    return [(first, tool_call_text(task["expression"])), (second, task["answer"])]


def build_calculator_model(path: Path, tasks: list[dict[str, Any]], *, steps: int = 60, lr: float = 8e-3) -> Path:
    """The tiny model (seed 0) after `steps` of AdamW on the calculator conversations of `tasks`; each answer is
    followed by <|im_end|>, so generation stops there. Saved to `path` as a Hugging Face directory."""
    build_tiny_model(path, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = []
    for task in tasks:
        for messages, answer in calculator_conversations(task):
            text = tokenizer.apply_chat_template(
                messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer.encode(text, add_special_tokens=False)
            target = tokenizer.encode(answer, add_special_tokens=False) + [end]
            rows.append((prompt, target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    threads = torch.get_num_threads()
    # One thread: on a busy 2-core machine more threads make these small matmuls ten times slower (measured).
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.train()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = sum(_answer_loss(model, prompt, target) for prompt, target in rows) / len(rows)
            loss.backward()
            optimizer.step()
    torch.set_num_threads(threads)
    model.eval()
    with no_progress_bars():
        model.save_pretrained(path)
    return path


def _answer_loss(model: Any, prompt: list[int], target: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + target])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(target))
