"""An LLM call the run's proxy answered with an error (HTTP 400: agl 0.3.0's spider agent asks for a ~780-token
prompt and max_tokens=2048 of the tiny model, whose context is 512) has no token ids, like a call the agent made
with its own client, but the client is not the problem. Found running spider's train_sql_agent.py by hand: the
iteration stopped with `NoTrainingRows` blaming the agent's client for 256 calls that went through the proxy."""

from __future__ import annotations

from types import SimpleNamespace

from test_adapter import llm_span, reward_span

from lightning import reporting, semconv
from lightning.adapter import spans_to_triplets


def refused(seq: int, span_id: str, start: float, end: float, status: int = 400):  # noqa: ANN201
    span = llm_span(seq, span_id, start, end, prompt=None, responses=None)
    return span.model_copy(update={"attributes": {**span.attributes, semconv.LLM_HTTP_STATUS: status}})


def test_a_call_the_proxy_answered_with_an_error_is_counted_as_failed_not_as_the_agent_s_own_client() -> None:
    spans = [
        refused(1, "refused", 1, 2),
        llm_span(2, "own-client", 3, 4, prompt=None, responses=None),
        llm_span(3, "ok", 5, 6, prompt=[1], responses=[[2]]),
        reward_span(4, "r", 1.0, 7),
    ]
    result = spans_to_triplets(spans)
    assert [t.metadata["span_id"] for t in result.triplets] == ["ok"]
    assert (result.report.failed_calls, result.report.calls_without_token_ids) == (1, 1)
    assert any("refused" in line and "HTTP 400" in line for line in result.report.problems)


def test_no_rows_from_failed_calls_says_so_without_blaming_the_client() -> None:
    result = spans_to_triplets([refused(1, "a", 1, 2), refused(2, "b", 3, 4, status=500)])
    assert result.report.failed_calls == 2 and result.report.calls_without_token_ids == 0
    run = SimpleNamespace(config=SimpleNamespace(max_prompt_length=64))
    reason = reporting.no_rows_reason(run, 0, 1, result.report, "no rows", None)  # type: ignore[arg-type]
    assert "2 LLM calls through the run's proxy were answered with an error" in reason, reason
    assert "own client" not in reason, reason
