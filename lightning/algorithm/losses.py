"""The PPO loss terms over [B, R] response tensors, with verl's definitions (verl/trainer/ppo/core_algos.py).

Every function is pure; `response_mask` (1 on generated tokens) says which tokens count.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from lightning.algorithm.config import KLKind, LossAggMode


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where mask is 1; 0 when the mask is empty (verl divides by mask.sum() unguarded)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position, in float32: logit[label] - logsumexp(logits)."""
    logits = logits.float()
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) per position: logsumexp(z) - sum_i p_i z_i (verl_F.entropy_from_logits)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_log_probs and entropy_from_logits of the logits z = (hidden @ weight.T + bias) / temperature, for
    [N, H] hidden states and [N] labels, `chunk_tokens` rows at a time (None: all at once). With gradients on and
    chunks, each chunk's logits are recomputed in the backward pass instead of kept, so at most one chunk's
    [chunk_tokens x vocab] float32 logits exist at any time: N x vocab never does. The entropy carries gradient
    only with `entropy_grad`."""

    def chunk(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(h, weight, bias) / temperature
        return token_log_probs(logits, y), entropy_from_logits(logits if entropy_grad else logits.detach())

    if chunk_tokens is None or len(hidden) <= chunk_tokens:
        return chunk(hidden, labels)
    recompute = torch.is_grad_enabled()
    parts = [
        torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=False) if recompute else chunk(h, y)
        for h, y in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True)
    ]
    return torch.cat([log_probs for log_probs, _ in parts]), torch.cat([entropy for _, entropy in parts])


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    batch_num_tokens: float | torch.Tensor | None = None,
    batch_num_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """verl's agg_loss: a [B, R] loss matrix to a scalar.

    token-mean:              sum of all masked tokens / number of masked tokens
    seq-mean-token-sum:      mean over sequences of each sequence's token sum
    seq-mean-token-mean:     mean over sequences of each sequence's token mean
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (Dr. GRPO, https://arxiv.org/abs/2503.20783:
                             a constant, by default R, where GRPO divides by each sequence's own length)
    Sequences with no masked token are left out of the sequence means.

    With gradient accumulation pass the whole mini-batch's counts as `batch_num_tokens` / `batch_num_seqs`:
    the micro-batch losses then add up to the mini-batch loss exactly (verl's global_batch_info does the same).
    """
    mask = mask.to(loss_mat.dtype)
    tokens_per_seq = mask.sum(dim=-1)
    has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)
    if mode == "token-mean":
        denominator = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / _at_least_one(denominator)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss_mat * mask).sum(dim=-1)
    elif mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * mask).sum(dim=-1) / (tokens_per_seq + 1e-8)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    denominator = has_tokens.sum() if batch_num_seqs is None else batch_num_seqs
    loss = (seq_losses * has_tokens).sum() / _at_least_one(denominator)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or loss_mat.shape[-1])
    return loss


def _at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float = 3.0,
    agg: LossAggMode = "token-mean",
    batch_num_tokens: float | torch.Tensor | None = None,
    batch_num_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with dual clip (verl's compute_policy_loss_vanilla).

    ratio = exp(log_probs - old_log_probs), the log-ratio clamped to [-20, 20]
    L     = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    where A < 0, also capped by dual clip: L = min(L, -A * dual_clip_c)   (https://arxiv.org/abs/1912.09729)
    with `importance_weights` w (off-policy samples: `behaviour_weights`), each token's L becomes w * L

    Metrics: clip_frac (tokens where the clipped term wins), approx_kl (k1 of old vs new, mean over
    tokens), dual_clip_frac (tokens with A < 0 where the dual clip cap wins).
    """
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be greater than 1, got {dual_clip_c}")
    log_ratio = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_loss = torch.maximum(unclipped, clipped)
    dual_clip_cap = -advantages * dual_clip_c
    dual_clipped_loss = torch.minimum(clipped_loss, dual_clip_cap)
    loss_mat = torch.where(advantages < 0, dual_clipped_loss, clipped_loss)
    if importance_weights is not None:
        loss_mat = importance_weights.detach() * loss_mat

    loss = aggregate(loss_mat, response_mask, agg, batch_num_tokens, batch_num_seqs, loss_scale_factor)
    metrics = {
        "clip_frac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
        "dual_clip_frac": masked_mean(
            ((clipped_loss > dual_clip_cap) & (advantages < 0)).float(), response_mask
        ).detach(),
    }
    return loss, metrics


def behaviour_weights(
    old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, cap: float | None = None
) -> torch.Tensor:
    """The importance weight of each sampled token, from the policy that sampled it (the behaviour policy) to the
    old (proximal) policy of the PPO ratio:

    w = pi_old / pi_behav = exp(old_log_probs - behaviour_log_probs), the log-ratio clamped to [-20, 20]
    decoupled PPO (https://arxiv.org/abs/2110.00641): w as is (cap None)
    truncated IS (https://fengyao.notion.site/off-policy-rl): min(w, cap)
    """
    weights = torch.exp(torch.clamp(old_log_probs - behaviour_log_probs, min=-20.0, max=20.0))
    return weights if cap is None else torch.clamp(weights, max=cap)


def importance_metrics(
    old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> dict[str, float]:
    """is_ratio_mean and is_ratio_max of pi_old / pi_behav over the masked tokens (before any cap), and
    is_ratio_clipped_frac: the share of them above `cap` (0 without one)."""
    weights = behaviour_weights(old_log_probs, behaviour_log_probs)
    chosen = weights[mask.bool()]
    if chosen.numel() == 0:
        return {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "is_ratio_clipped_frac": 0.0}
    clipped = (chosen > cap).float().mean() if cap is not None else torch.tensor(0.0)
    return {
        "is_ratio_mean": float(chosen.mean()),
        "is_ratio_max": float(chosen.max()),
        "is_ratio_clipped_frac": float(clipped),
    }


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (http://joschu.net/blog/kl-approx.html).

    k1:         log p - log q
    low_var_kl: k3 = q/p - log(q/p) - 1, log(q/p) clamped to [-20, 20] and the result to [-10, 10] (as verl)
    """
    if kind == "k1":
        return log_probs - ref_log_probs
    if kind == "low_var_kl":
        log_ref_ratio = torch.clamp(ref_log_probs - log_probs, min=-20.0, max=20.0)
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        return torch.clamp(k3, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1' or 'low_var_kl'")
