"""Multi-turn trajectories: a hand-built three-turn rollout's rows and masks token by token, groups by task and
turn, the loss blind to masked tokens, and the proxy joining turns token-exactly through the real embedded server
even when the chat template renders the conversation differently from what the model generated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning import semconv
from lightning.adapter import AdaptReport, spans_to_triplets
from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.config import TrainerConfig
from lightning.algorithm.trainer import TorchTrainer
from lightning.reporting import tool_use_collapse
from lightning.types import Span, TraceStatus

ROLLOUT, ATTEMPT = "ro-mt", "at-mt"
END = 99  # the turn's end token of these hand-built ids
# Three turns: each prompt is the previous prompt + response + the bridge (the tool's result and the next header).
P0, R0 = [1, 2, 3], [10, 11, END]
B1, R1 = [20, 21], [12, END]
B2, R2 = [22, 23, 24], [13, 14, END]
P1 = P0 + R0 + B1
P2 = P1 + R1 + B2
TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "lookup", "arguments": "{\"key\": \"bd\"}"}}]}  # fmt: skip


def call_span(seq: int, prompt: list[int], response: list[int], logprobs: list[float], *, tool: bool) -> Span:
    output = TOOL_CALL if tool else {"role": "assistant", "content": "k"}
    attributes: dict[str, Any] = {
        semconv.GEN_AI_OPERATION: "chat",
        semconv.GEN_AI_FINISH_REASONS: ["tool_calls" if tool else "stop"],
        semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([output]),
        semconv.LLM_PROMPT_TOKEN_IDS: semconv.encode_token_ids(prompt),
        semconv.LLM_RESPONSE_TOKEN_IDS: [semconv.encode_token_ids(response)],
        semconv.LLM_RESPONSE_LOGPROBS: [semconv.encode_logprobs(logprobs)],
    }
    if seq:
        attributes[semconv.LLM_CONTINUATION] = "joined"
    return Span(
        rollout_id=ROLLOUT, attempt_id=ATTEMPT, sequence_id=seq, trace_id="t" * 32, span_id=f"s{seq}",
        name="chat tiny", status=TraceStatus(status_code="OK"), attributes=attributes,
        start_time=float(seq), end_time=seq + 0.5,
    )  # fmt: skip


def three_turns(reward: float = 1.0) -> list[Span]:
    reward_span = Span(
        rollout_id=ROLLOUT, attempt_id=ATTEMPT, sequence_id=3, trace_id="t" * 32, span_id="r", name=semconv.REWARD_SPAN,
        attributes={semconv.REWARD_VALUE: reward}, start_time=3.0, end_time=3.0,
    )  # fmt: skip
    return [
        call_span(0, P0, R0, [-0.1, -0.2, -0.3], tool=True),
        call_span(1, P1, R1, [-0.4, -0.5], tool=True),
        call_span(2, P2, R2, [-0.6, -0.7, -0.8], tool=False),
        reward_span,
    ]


def test_a_three_turn_trajectory_is_one_row_masked_token_by_token() -> None:
    result = spans_to_triplets(three_turns(), shape="trajectory", group_id="task-7")
    assert result.report.trajectory_splits == 0
    [row] = result.triplets
    assert row.prompt == P0
    assert row.response == R0 + B1 + R1 + B2 + R2
    # generated 1, the bridges (tool results, template text) 0
    assert row.response_mask == [1, 1, 1] + [0, 0] + [1, 1] + [0, 0, 0] + [1, 1, 1]
    expected = [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0, 0, 0, -0.6, -0.7, -0.8]  # float32 on the span
    assert row.metadata[semconv.TRIPLET_RESPONSE_LOG_PROBS] == pytest.approx(expected, abs=1e-6)
    assert row.metadata["group_id"] == "task-7" and "advantage_group" not in row.metadata
    assert (result.report.tokens_trained, result.report.tokens_masked) == (8, 5)
    assert (result.report.tool_calls, result.report.rollouts_with_tool_calls) == (2, 1)


def test_transitions_group_by_task_and_turn() -> None:
    result = spans_to_triplets(three_turns(), shape="transition", group_id="task-7")
    assert [t.prompt for t in result.triplets] == [P0, P1, P2]
    groups = [t.metadata["advantage_group"] for t in result.triplets]
    assert groups == ["task-7/turn-0", "task-7/turn-1", "task-7/turn-2"]
    assert all(t.metadata["group_id"] == "task-7" for t in result.triplets)  # the rollout's task, for sampling
    batch = TrainingBatch.from_triplets(result.triplets, pad_token_id=0, max_prompt_length=64, max_response_length=16)
    assert list(batch.uid) == ["task-7/turn-0", "task-7/turn-1", "task-7/turn-2"]


def test_a_split_names_the_proxys_reason() -> None:
    spans = three_turns()
    spans[2].attributes[semconv.LLM_PROMPT_TOKEN_IDS] = semconv.encode_token_ids([1, 2, 3, 77])
    reason = "the previous response did not end its turn (cut off by max_tokens?)"
    spans[2].attributes[semconv.LLM_CONTINUATION] = reason
    result = spans_to_triplets(spans, shape="trajectory")
    assert result.report.trajectory_splits == 1
    assert result.report.split_reasons == {reason: 1}
    assert len(result.triplets) == 2


def test_the_iteration_row_reports_turns_tools_and_masks() -> None:
    report = spans_to_triplets(three_turns(), shape="trajectory").report
    assert report.turn_metrics() == {
        "turns": 3.0, "tool_calls": 2.0, "tool_use": 1.0, "tokens_trained": 8, "tokens_masked": 5,
        "trajectory_splits": 0,
    }  # fmt: skip
    single = AdaptReport(rollouts=4, llm_calls=4)
    assert single.turn_metrics() == {}  # a one-call agent without tools: nothing to say
    history = [{"iteration": 0, "tool_use": 0.9}, {"iteration": 1, "tool_use": 0.8}]
    assert tool_use_collapse(history, {"iteration": 2, "tool_use": 0.6}) is None
    assert "tool use collapsed: 30%" in (tool_use_collapse(history, {"iteration": 2, "tool_use": 0.3}) or "")


@pytest.mark.usefixtures("one_torch_thread")
def test_the_loss_ignores_masked_tokens(tiny_dir: Path) -> None:
    """The same update whatever the sampler's log-probs say at masked positions (the PPO ratio's denominator here:
    old_log_probs 'sampler'); changing one at a generated position changes it (the test can fail)."""

    def rows(changed: dict[int, float]) -> TrainingBatch:
        vocab = [5, 6, 7, 8, 9, 30, 31, 32, 33, 34, 35, 36, 37]
        triplets = []
        for reward in (1.0, 0.0):  # one group, rewards that differ: a non-zero advantage on every generated token
            [row] = spans_to_triplets(three_turns(reward), shape="trajectory", group_id="g").triplets
            row.prompt, row.response = [4, 5, 6], vocab  # ids the tiny vocabulary has
            logprobs = list(row.metadata[semconv.TRIPLET_RESPONSE_LOG_PROBS])
            for position, value in changed.items():
                logprobs[position] = value
            row.metadata[semconv.TRIPLET_RESPONSE_LOG_PROBS] = logprobs
            triplets.append(row)
        return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=16)

    def update(batch: TrainingBatch) -> list[torch.Tensor]:
        trainer = TorchTrainer(tiny_dir, TrainerConfig(lr=1e-2, kl_coef=0.0, old_log_probs="sampler", seed=0))
        trainer.step(batch)
        return [parameter.detach().clone() for parameter in trainer.model.parameters()]

    masked = [3, 4, 7, 8, 9]  # where the mask is 0
    assert all(rows({})["response_mask"][0, position] == 0 for position in masked)
    plain = update(rows({}))
    shifted = update(rows({position: -7.5 for position in masked}))
    assert all(torch.equal(a, b) for a, b in zip(plain, shifted, strict=True))
    generated = update(rows({0: -7.5}))
    assert not all(torch.equal(a, b) for a, b in zip(plain, generated, strict=True))


# ---- the proxy joins turns token-exactly, through the real embedded server ---------------------------------------

DRIFT = ('<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
         "{{ arguments if arguments is string else arguments | tojson }}}</tool_call>")  # fmt: skip


@pytest.fixture(scope="module")
def drifting_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught the calculator's two turns, then given a chat template that renders an assistant's tool
    call as compact JSON: the model generated `{"expression": "1 + 2"}`, the template renders it again as
    `{"expression":"1 + 2"}`, so the conversation rendered again is not the ids the model saw and said."""
    from support.tool_model import build_calculator_model

    from examples.calculator.agent import load_tasks
    from lightning.models.tiny import CHAT_TEMPLATE

    path = build_calculator_model(tmp_path_factory.mktemp("models") / "drifting", load_tasks()[:2])
    assert DRIFT in CHAT_TEMPLATE
    compact = DRIFT.replace(
        "{{ arguments if arguments is string else arguments | tojson }}",
        "{{ (arguments if arguments is string else arguments | tojson) | replace(': ', ':') }}",
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace(DRIFT, compact))
    return path


async def run_calculator(model: Path, store_path: Path, *, tokenizer: Any) -> tuple[Any, list[Any]]:
    """The calculator agent on two tasks through the LLM proxy and the embedded server serving `model`."""
    from support.multi_turn import calculator_through_proxy
    from support.servers import serving

    from lightning.inference import create_inference_app

    app = create_inference_app(model, served_model_name="tiny")
    try:
        with serving(app) as url:
            return await calculator_through_proxy(f"{url}/v1", store_path, tokenizer=tokenizer)
    finally:
        app.state.engine.stop()


@pytest.mark.slow
async def test_turns_join_token_exactly_whatever_the_template_renders(drifting_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from examples.calculator.agent import CALCULATOR_TOOL
    from lightning.chat import render_ids

    tokenizer = AutoTokenizer.from_pretrained(drifting_model)
    adapted, spans = await run_calculator(drifting_model, tmp_path / "joined.db", tokenizer=str(drifting_model))
    report = adapted.report
    assert (report.rollouts_with_triplets, report.trajectory_splits, len(adapted.triplets)) == (2, 0, 2)
    assert report.tool_calls == 2 and report.rollouts_with_tool_calls == 2
    assert all(row.reward == 1.0 for row in adapted.triplets)  # the model saw exactly what it was taught
    continued = [span for span in spans if span.attributes.get(semconv.LLM_CONTINUATION)]
    assert [span.attributes[semconv.LLM_CONTINUATION] for span in continued] == ["joined", "joined"]
    for row in adapted.triplets:
        mask = row.response_mask
        assert mask is not None and mask[0] == 1 and 0 in mask and mask[-1] == 1
        # The template drifts: the conversation rendered again is not the row's ids.
        [second] = [s for s in continued if s.rollout_id == row.metadata["rollout_id"]]
        messages = json.loads(second.attributes[semconv.GEN_AI_INPUT_MESSAGES])
        rendered = render_ids(tokenizer, messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True)
        joined = semconv.decode_token_ids(second.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
        assert joined == row.prompt + row.response[: len(joined) - len(row.prompt)]
        assert rendered != joined

    # The control: without the tokenizer the server renders each call again, and every rollout's row splits.
    plain, _ = await run_calculator(drifting_model, tmp_path / "plain.db", tokenizer=None)
    assert plain.report.trajectory_splits == 2
    assert plain.report.split_reasons == {"the prompt does not extend the conversation so far": 2}


def test_the_proxy_loads_its_tokenizer_when_a_call_first_continues_but_refuses_a_directory_without_one(
    tmp_path: Path,
) -> None:
    """A one-call agent's proxy never pays for transformers' tokenizer import (the joined run above loads it on its
    first continuation); a directory with no tokenizer is still refused when the proxy starts, not on that call."""
    from lightning.proxy.continuation import Conversations

    with pytest.raises(ValueError, match="no tokenizer_config.json there; give a model directory"):
        Conversations(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    assert Conversations(tmp_path / "model")._tokenizer == tmp_path / "model"  # not loaded until needed


def test_a_completion_answers_as_the_chat_completion_the_agent_asked_for() -> None:
    """Where the backend has no token-in chat route (vLLM 0.32), a continued call goes as a completions call on the
    joined ids, and its answer comes back in chat's shape: tool calls parsed, log-probs and token ids kept."""
    from lightning.proxy.app import chat_as_completion, completion_as_chat

    asked = {"model": "tiny", "messages": [], "tools": [{}], "temperature": 0.7, "max_completion_tokens": 9, "seed": 3}
    assert chat_as_completion(asked, [5, 6]) == {
        "model": "tiny", "temperature": 0.7, "seed": 3, "max_tokens": 9, "prompt": [5, 6],
    }  # fmt: skip
    text = '<tool_call>{"name": "lookup", "arguments": {"key": "bd"}}</tool_call>'
    completion = {
        "id": "cmpl-1", "model": "tiny", "usage": {"prompt_tokens": 2},
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": [7, 8], "prompt_token_ids": [5, 6],
                     "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25]}}],
    }  # fmt: skip
    answer = completion_as_chat(completion, parse_tools=True)
    [choice] = answer["choices"]
    assert answer["prompt_token_ids"] == [5, 6] and choice["token_ids"] == [7, 8]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"key": "bd"}'}
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5, -0.25]
    plain = completion_as_chat(completion, parse_tools=False)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": text} and plain["finish_reason"] == "stop"
