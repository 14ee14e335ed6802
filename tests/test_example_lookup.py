"""The multi-turn example (examples/lookup): its tool and tasks, its demonstrations token by token, and `make
lookup`'s command shrunk to one short iteration: rollouts with tool calls, one joined trajectory row each, the
per-turn metrics in the run's history."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.scripted_agl import scripted_chat_app
from support.servers import serving

from examples.lookup.agent import (
    KEYS,
    LOOKUP_TOOL,
    demonstrations,
    hasty_demonstrations,
    lookup_agent,
    make_tasks,
    run_tool,
    table,
)
from examples.lookup.data import train_tasks, val_tasks
from lightning.chat import render_ids
from lightning.checkpoint import latest_checkpoint, load_checkpoint
from lightning.models.tiny import build_tokenizer
from lightning.types import LLM

REPO = Path(__file__).resolve().parent.parent
CONFIG = "examples/lookup/train.yaml"


def test_only_the_tool_knows_the_answer() -> None:
    entries = table(5)
    assert sorted(entries) == sorted(KEYS) and entries == table(5) and entries != table(6)
    pointers = [key for key, entry in entries.items() if entry.startswith("next ")]
    assert len(pointers) == round(len(KEYS) / 3)
    assert all(not entries[entry.removeprefix("next ")].startswith("next ") for entry in map(entries.get, pointers))
    assert run_tool(entries, "lookup", '{"key": "d"}') == entries["d"]
    assert run_tool(entries, "lookup", "not json").startswith("error")
    assert run_tool(entries, "search", "{}").startswith("error")
    [task] = make_tasks(1, first_table=5)
    entry = entries[task["key"]]
    assert task["value"] == (entries[entry[5:]] if entry.startswith("next ") else entry)
    assert task["calls"] == (2 if entry.startswith("next ") else 1)
    # Held-out tables never occur in training; about a third of the tasks need two calls.
    assert not {t["table"] for t in train_tasks()} & {t["table"] for t in val_tasks()}
    assert 0.25 < sum(t["calls"] == 2 for t in train_tasks()) / len(train_tasks()) < 0.4


def test_a_demonstration_is_the_conversation_token_by_token() -> None:
    tokenizer = build_tokenizer()
    two_calls = next(task for task in train_tasks() if task["calls"] == 2)
    [row] = demonstrations(tokenizer, [two_calls])
    assert row.prompt == render_ids(
        tokenizer, [{"role": "user", "content": two_calls["key"]}], tools=[LOOKUP_TOOL], add_generation_prompt=True
    )
    mask = row.response_mask or []
    trained = tokenizer.decode([t for t, m in zip(row.response, mask, strict=True) if m])
    masked = tokenizer.decode([t for t, m in zip(row.response, mask, strict=True) if not m])
    pointer = table(two_calls["table"])[two_calls["key"]]
    call = '<tool_call>{{"name": "lookup", "arguments": {{"key": "{}"}}}}</tool_call><|im_end|>'
    assert trained == call.format(two_calls["key"]) + call.format(pointer[5:]) + f"{two_calls['value']}<|im_end|>"
    assert masked == (
        f"\n<|im_start|>tool\n{pointer}<|im_end|>\n<|im_start|>assistant\n"
        f"\n<|im_start|>tool\n{two_calls['value']}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_hasty_demonstrator_follows_2_of_10_pointers_and_answers_the_pointed_letter_otherwise() -> None:
    tokenizer = build_tokenizer()
    pointed = [task for task in train_tasks() if task["calls"] == 2][:10]
    rows = hasty_demonstrations(tokenizer, pointed)
    ends = tokenizer.convert_tokens_to_ids("<|im_end|>")  # 5 in a followed pointer (3 turns, 2 tool results), else 3
    followed = [row for row in rows if row.response.count(ends) == 5]
    assert len(followed) == 2 and all(row.reward == 1.0 for row in followed)
    task, row = next((t, r) for t, r in zip(pointed, rows, strict=True) if r not in followed)
    mask = row.response_mask or []
    trained = tokenizer.decode([t for t, m in zip(row.response, mask, strict=True) if m])
    pointer = table(task["table"])[task["key"]][5:]
    call = f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{task["key"]}"}}}}</tool_call><|im_end|>'
    assert trained == f"{call}{pointer}<|im_end|>"  # one call, then the letter the pointer names
    assert row.reward == (1.0 if pointer == task["value"] else 0.0)


async def test_a_reply_cut_off_at_max_tokens_ends_the_rollout_without_an_answer() -> None:
    """A tool call followed by text that ran on to max_tokens ("length"): the agent neither runs the cut call nor
    goes on (its next prompt could not continue the cut turn token for token), and earns nothing."""
    task = next(task for task in train_tasks() if task["calls"] == 1)
    call = {
        "id": "call-0",
        "type": "function",
        "function": {"name": "lookup", "arguments": f'{{"key": "{task["key"]}"}}'},
    }
    app = scripted_chat_app(
        lambda body: {"role": "assistant", "content": "g g g", "tool_calls": [call], "finish_reason": "length"}
    )
    with serving(app) as url:
        reward = await lookup_agent.func(task, llm=LLM(endpoint=f"{url}/v1", model="m"))
    assert reward == 0.0 and len(app.state.requests) == 1


@pytest.mark.slow
def test_make_lookup_trains_joined_trajectories(tmp_path: Path) -> None:
    """`python -m flows.train examples/lookup/train.yaml --set run_name=...` (what `make lookup` runs), shrunk to one
    iteration of 4 tasks after a 20-step warm start, with trajectory rows: a rollout's turns joined by the proxy (the
    example's default, a row per call, is what the joining is not needed for)."""
    sets = [
        f"store_url=sqlite:///{tmp_path}/store.db", f"tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"output_dir={tmp_path}/runs", "run_name=lookup-test", "iterations=1", "batch_size=4", "samples_per_task=4",
        "warm_start.steps=20", "warm_start.batch_size=null", "dynamic_sampling=false", "eval_every=0", "n_runners=1",
        "adapter_shape=trajectory",
        "tiny_model.init_std=0.2",  # the wide default: after 20 steps it calls the tool (the example's 0.02, by 125)
        "trainer_threads=1",  # the example's 2 threads stall at OpenMP barriers beside the other tests' processes
    ]  # fmt: skip
    command = [sys.executable, "-m", "flows.train", CONFIG]
    for override in sets:
        command += ["--set", override]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "turns " in done.stderr and "tool use " in done.stderr  # the progress line's multi-turn part
    [row] = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "lookup-test" / "checkpoints")).meta["history"]
    assert row["rows"] == 16 and row["tool_use"] > 0 and row["turns"] > 1, row
    assert row["trajectory_splits"] == 0 and row["tokens_masked"] > 0 and row["tokens_trained"] > 0
    assert json.loads(json.dumps(row))  # MLflow gets plain numbers
