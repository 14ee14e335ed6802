"""An arithmetic agent with a calculator tool: the first example of an agent written with `@rollout`.

It talks to whatever OpenAI-compatible endpoint its `LLM` resource names (through the LLM proxy
during training), lets the model call a `calculator` tool, and earns reward 1.0 when its final
answer equals the task's answer.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any

from openai import OpenAI

from lightning.agent import rollout
from lightning.types import LLM

TASKS = Path(__file__).with_name("tasks.jsonl")
MAX_TURNS = 4
SYSTEM_PROMPT = (
    "You solve arithmetic problems. Use the calculator tool for any computation, then answer with the number alone."
)
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 + 4) * 3"}},
            "required": ["expression"],
        },
    },
}


@rollout
def calculator_agent(task: dict[str, Any], llm: LLM) -> float:
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    answer = ""
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(
            model=llm.model, messages=messages, tools=[CALCULATOR_TOOL], **llm.sampling_parameters
        )
        message = response.choices[0].message
        if not message.tool_calls:
            answer = message.content or ""
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)})
    return reward(answer, task["answer"])


def run_tool(arguments: str) -> str:
    """The calculator tool's reply to the model; errors are told to the model, not raised."""
    try:
        return str(calculate(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, ZeroDivisionError) as exc:
        return f"error: {exc}"


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic by walking its syntax tree: numbers and operators only, never eval()."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(expression, mode="eval").body)


def reward(answer: str, expected: str) -> float:
    """1.0 if the last number in the answer equals the expected one, else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(expected) else 0.0


def load_tasks(path: Path = TASKS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
