"""A text-to-SQL agent in agent-lightning 0.3's style (its Spider example's shape, our own code): the model writes a
SQLite query for a question, the agent runs it, and when it fails the model is shown the error and rewrites it.
Reward: True when the query returns the same rows as the reference query.

Written as for agent-lightning, with `import lightning as agl`: a `LitAgent` subclass calling
`super().__init__(trained_agents=...)`, the `main_llm` resource, `self.tracer`, `agl.emit_reward` with keywords, and a
bool returned as the reward.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path
from typing import Any

from openai import OpenAI

import lightning as agl
from examples.agl_common import jsonl_tasks

MAX_TURNS = 3
SCHEMA = """\
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), amount REAL, day TEXT);
"""
ROWS = """\
INSERT INTO customers VALUES (1, 'Ada', 'Paris'), (2, 'Ben', 'Lyon'), (3, 'Chloe', 'Paris'), (4, 'Dan', 'Nice');
INSERT INTO orders VALUES (1, 1, 30.0, '2025-01-03'), (2, 1, 12.5, '2025-01-09'), (3, 2, 99.0, '2025-02-01'),
    (4, 3, 7.25, '2025-02-14'), (5, 3, 45.0, '2025-03-02'), (6, 3, 15.0, '2025-03-20');
"""
SYSTEM_PROMPT = (
    "You write SQLite queries. The database:\n{schema}\nAnswer with one query in a ```sql block and nothing else."
)
TASKS = Path(__file__).with_name("tasks.jsonl")


class LitSqlAgent(agl.LitAgent[dict[str, Any]]):
    def __init__(self, trained_agents: str | None = r"write", max_turns: int = MAX_TURNS) -> None:
        super().__init__(trained_agents=trained_agents)
        self.max_turns = max_turns

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> bool:
        llm: agl.LLM = resources["main_llm"]  # type: ignore[assignment]
        # agent-lightning agents hand this to LangChain; here the LLM proxy records the calls, and it is None.
        callbacks = [handler] if (handler := self.tracer.get_langchain_handler()) else []
        base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)  # type: ignore[attr-defined]
        client = OpenAI(base_url=base_url, api_key=llm.api_key or "dummy", max_retries=0)
        with contextlib.closing(open_database()) as database:
            return self._solve(task, llm, client, database, len(callbacks))

    def _solve(
        self, task: dict[str, Any], llm: agl.LLM, client: OpenAI, database: sqlite3.Connection, callbacks: int
    ) -> bool:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(schema=SCHEMA)},
            {"role": "user", "content": task["question"]},
        ]
        rows: list[tuple[Any, ...]] | None = None
        turns = 0
        while rows is None and turns < self.max_turns:
            turns += 1
            response = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
            reply = response.choices[0].message.content or ""
            query = extract_query(reply)
            try:
                rows = database.execute(query).fetchall()
            except sqlite3.Error as exc:
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"The query failed: {exc}. Write a corrected query."},
                ]
        correct = rows is not None and same_rows(rows, database.execute(task["gold_sql"]).fetchall())
        agl.emit_reward(
            {"correct": correct, "executes": rows is not None},
            primary_key="correct",
            attributes={"turns": turns, "callbacks": callbacks},
        )
        return correct


def open_database() -> sqlite3.Connection:
    """The example database, in memory; a query running past ~10M SQLite steps is interrupted."""
    database = sqlite3.connect(":memory:")
    database.executescript(SCHEMA + ROWS)
    steps = iter(range(1000))
    database.set_progress_handler(lambda: next(steps, None) is None, 10_000)
    return database


def extract_query(reply: str) -> str:
    """The query in the reply's ```sql block, or the whole reply."""
    block = re.search(r"```(?:sql)?\s*(.+?)```", reply, re.DOTALL | re.IGNORECASE)
    return (block.group(1) if block else reply).strip()


def same_rows(found: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> bool:
    return sorted(map(repr, found)) == sorted(map(repr, expected))


def tasks() -> list[dict[str, Any]]:
    """Questions about the database, each with a reference query."""
    return jsonl_tasks(TASKS)


def train_tasks() -> list[dict[str, Any]]:
    return tasks()[:8]


def val_tasks() -> list[dict[str, Any]]:
    return tasks()[8:]
