"""The train/inference mismatch of stored rollouts: for each LLM call the proxy stored with its token ids and the
sampler's log-probs, Hugging Face Transformers recomputes the log-prob of every sampled token on a model directory,
and the two are compared token by token (`lightning debug compare-logprobs`).

Run on the checkpoint the rollouts were sampled from, the differences are the engines' (kernels, dtype, batching):
about 1e-6 in float32 for the tiny model on vLLM's CPU build or our embedded server; bfloat16 engines show about
1e-2. Far larger values mean the engine did not serve those weights (a reload that failed, another checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.types import Span


@dataclass
class TokenComparison:
    rollout_id: str
    span_id: str
    position: int
    """Index of the token in the call's response."""
    token_id: int
    token: str
    engine: float
    trainer: float

    @property
    def delta(self) -> float:
        return abs(self.engine - self.trainer)


@dataclass
class MismatchReport:
    tokens: list[TokenComparison] = field(default_factory=list)
    calls: int = 0
    calls_without_log_probs: int = 0
    """LLM calls whose span has no sampler log-probs (a backend that sends none, an older proxy)."""

    def summary(self, threshold: float) -> dict[str, float]:
        """The trainer's mismatch metrics (`mismatch_mean`, `mismatch_max`, `mismatch_frac`) over every token."""
        import torch

        from lightning.algorithm.trainer import mismatch_metrics

        engine = torch.tensor([token.engine for token in self.tokens])
        trainer = torch.tensor([token.trainer for token in self.tokens])
        return {"tokens": len(self.tokens), **mismatch_metrics(engine, trainer, torch.ones_like(engine), threshold)}


async def compare_logprobs(
    store: LightningStore, model_dir: str | Path, rollout_ids: list[str], *, device: str = "cpu"
) -> MismatchReport:
    """Recompute, with Transformers in float32 on `model_dir`, the log-prob of each sampled token of the LLM calls
    of `rollout_ids`, beside the one the engine sent. The spans are read first: an unknown rollout or a store that
    does not answer fails before a model loads."""
    return compare_spans(await read_spans(store, rollout_ids), model_dir, device=device)


async def read_spans(store: LightningStore, rollout_ids: list[str]) -> dict[str, list[Span]]:
    """The spans of each rollout (a NotFoundError names an unknown one)."""
    return {rollout_id: list(await store.query_spans(rollout_id)) for rollout_id in rollout_ids}


def compare_spans(spans: dict[str, list[Span]], model_dir: str | Path, *, device: str = "cpu") -> MismatchReport:
    """`compare_logprobs` on spans already read, by rollout id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning.algorithm.losses import token_log_probs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    report = MismatchReport()
    for rollout_id, rollout_spans in spans.items():
        for span in rollout_spans:
            calls = _sampled_calls(span.attributes)
            if calls is None:
                continue
            report.calls += 1
            if not calls:
                report.calls_without_log_probs += 1
                continue
            for prompt, response, engine in calls:
                with torch.no_grad():  # the logit at position t predicts token t + 1, as in the trainer
                    logits = model(torch.tensor([prompt + response], device=device)).logits[0, len(prompt) - 1 : -1]
                ours = token_log_probs(logits, torch.tensor(response, device=device)).tolist()
                for position, (token_id, sampled, recomputed) in enumerate(zip(response, engine, ours, strict=True)):
                    token = tokenizer.decode([token_id])
                    report.tokens.append(
                        TokenComparison(rollout_id, span.span_id, position, token_id, token, sampled, recomputed)
                    )
    return report


def _sampled_calls(attributes: dict[str, Any]) -> list[tuple[list[int], list[int], list[float]]] | None:
    """(prompt, response, engine log-probs) per choice of an LLM call span; [] when it has token ids but no
    log-probs; None for a span that is not an LLM call with token ids."""
    if semconv.LLM_PROMPT_TOKEN_IDS not in attributes or semconv.LLM_RESPONSE_TOKEN_IDS not in attributes:
        return None
    prompt = semconv.decode_token_ids(attributes[semconv.LLM_PROMPT_TOKEN_IDS])
    responses = [semconv.decode_token_ids(encoded) for encoded in attributes[semconv.LLM_RESPONSE_TOKEN_IDS]]
    encoded = attributes.get(semconv.LLM_RESPONSE_LOGPROBS)
    if not isinstance(encoded, list) or len(encoded) != len(responses) or not prompt:
        return []
    calls = []
    for response, values in zip(responses, encoded, strict=True):
        logprobs = semconv.decode_logprobs(values)
        if response and len(logprobs) == len(response):
            calls.append((prompt, response, logprobs))
    return calls


def format_report(report: MismatchReport, threshold: float, show: int) -> str:
    """The `show` largest differences token by token, then the summary."""
    lines = [f"{'rollout':<24} {'span':<18} {'pos':>4} {'token':<14} {'engine':>10} {'trainer':>10} {'|delta|':>9}"]
    for token in sorted(report.tokens, key=lambda t: -t.delta)[:show]:
        text = repr(token.token)[:14]
        lines.append(
            f"{token.rollout_id[:24]:<24} {token.span_id[:18]:<18} {token.position:>4} {text:<14} "
            f"{token.engine:>10.5f} {token.trainer:>10.5f} {token.delta:>9.2e}"
        )
    summary = report.summary(threshold)
    lines.append("")
    if not summary["tokens"]:
        lines.append(
            f"no sampled tokens with the engine's log-probs in {report.calls} LLM calls "
            f"({report.calls_without_log_probs} without log-probs)"
        )
        return "\n".join(lines)
    lines.append(
        f"{summary['tokens']} sampled tokens in {report.calls} LLM calls: |engine - trainer| mean "
        f"{summary['mismatch_mean']:.2e}, max {summary['mismatch_max']:.2e}, {summary['mismatch_frac']:.1%} above "
        f"{threshold:g}"
        + (f"; {report.calls_without_log_probs} calls had no log-probs" if report.calls_without_log_probs else "")
    )
    return "\n".join(lines)
