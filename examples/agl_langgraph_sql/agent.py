"""A text-to-SQL agent on LangGraph, written as for agent-lightning 0.3 (the shape of its Spider example, our own
code): a graph of three nodes, `write` (the model writes a SQLite query), `execute` (the agent runs it) and
`rewrite` (shown the error, the model writes it again), looping until the query runs or the turns run out.
Reward: 1.0 when the query returns the same rows as the reference query.

Only its import lines differ from agent-lightning code: `agentlightning.litagent`, `.types` and `.emitter` become
`lightning.litagent`, `.types` and `.emitter`. Like agl's agents, it sends its own placeholder API key ("dummy"),
which the run's LLM proxy serves in the runs `Trainer` starts (`proxy_any_agent_key`). The database and the
questions are examples/agl_sql_agent's.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph
from openai import OpenAI

from examples.agl_sql_agent.agent import SCHEMA, extract_query, open_database, same_rows
from lightning.emitter import emit_reward
from lightning.litagent import LitAgent
from lightning.types import NamedResources, Rollout

SYSTEM_PROMPT = (
    "You write SQLite queries. The database:\n{schema}\nAnswer with one query in a ```sql block and nothing else."
)


class SqlState(TypedDict):
    messages: list[dict[str, Any]]
    query: str
    rows: list[tuple[Any, ...]] | None
    error: str | None
    turns: int


class LangGraphSqlAgent(LitAgent[dict[str, Any]]):
    def __init__(self, max_turns: int = 3) -> None:
        super().__init__(trained_agents="write")
        self.max_turns = max_turns

    def rollout(self, task: dict[str, Any], resources: NamedResources, rollout: Rollout) -> float:
        llm = resources["main_llm"]
        base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)  # type: ignore[union-attr]
        client = OpenAI(base_url=base_url, api_key="dummy", max_retries=0)
        with contextlib.closing(open_database()) as database:
            graph = self.build_graph(client, llm.model, llm.sampling_parameters, database)
            first = {"role": "user", "content": task["question"]}
            system = {"role": "system", "content": SYSTEM_PROMPT.format(schema=SCHEMA)}
            state = graph.invoke({"messages": [system, first], "query": "", "rows": None, "error": None, "turns": 0})
            gold = database.execute(task["gold_sql"]).fetchall()
        reward = 1.0 if state["rows"] is not None and same_rows(state["rows"], gold) else 0.0
        emit_reward(reward, attributes={"turns": state["turns"]})
        return reward

    def build_graph(self, client: OpenAI, model: str, sampling: dict[str, Any], database: sqlite3.Connection) -> Any:
        def write(state: SqlState) -> dict[str, Any]:
            response = client.chat.completions.create(model=model, messages=state["messages"], **sampling)
            reply = response.choices[0].message.content or ""
            return {
                "query": extract_query(reply),
                "messages": [*state["messages"], {"role": "assistant", "content": reply}],
                "turns": state["turns"] + 1,
            }

        def execute(state: SqlState) -> dict[str, Any]:
            try:
                return {"rows": database.execute(state["query"]).fetchall(), "error": None}
            except sqlite3.Error as exc:
                return {"rows": None, "error": str(exc)}

        def rewrite(state: SqlState) -> dict[str, Any]:
            told = {"role": "user", "content": f"The query failed: {state['error']}. Write a corrected query."}
            return {"messages": [*state["messages"], told]}

        def after_execute(state: SqlState) -> str:
            return END if state["error"] is None or state["turns"] >= self.max_turns else "rewrite"

        graph = StateGraph(SqlState)
        graph.add_node("write", write)
        graph.add_node("execute", execute)
        graph.add_node("rewrite", rewrite)
        graph.add_edge(START, "write")
        graph.add_edge("write", "execute")
        graph.add_conditional_edges("execute", after_execute, ["rewrite", END])
        graph.add_edge("rewrite", "write")
        return graph.compile()


langgraph_sql_agent = LangGraphSqlAgent()
