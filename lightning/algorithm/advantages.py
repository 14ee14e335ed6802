"""Outcome advantages over [B, R] token-level scores, with verl's definitions (verl/trainer/ppo/core_algos.py).

A row's sequence score is the sum of its token_level_scores; `uid` groups the rows sampled for the same task.
Every function returns [B, R] advantages that are 0 outside `response_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning.algorithm.losses import KLKind, kl_penalty


def group_rows(uid: Sequence[Any]) -> dict[Any, list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for row, group in enumerate(uid):
        groups.setdefault(group, []).append(row)
    return groups


def sequence_scores(scores: torch.Tensor) -> torch.Tensor:
    """[B, R] token-level scores -> [B] outcome score per row."""
    return scores.sum(dim=-1)


def grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased (torch.std); without norm_by_std, s_i - mean_g.

    As verl's compute_grpo_outcome_advantage: a group of one row has mean 0 and std 1, so A = s / (1 + eps).
    norm_by_std=False is Dr. GRPO (https://arxiv.org/abs/2503.20783).
    """
    seq = sequence_scores(scores)
    advantages = torch.empty_like(seq)
    for rows in group_rows(uid).values():
        group = seq[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group.mean(), group.std()
        advantages[rows] = (group - mean) / (std + eps) if norm_by_std else group - mean
    return advantages.unsqueeze(-1) * response_mask


def failed_group_advantages(
    advantages: torch.Tensor, scores: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any], value: float
) -> torch.Tensor:
    """Negative sample reinforcement for groups that all failed: each row of a group of two or more whose scores
    are equal and at most 0 gets `value` on its response tokens, in place of the 0 a group-relative advantage gives
    it. With `value` < 0 the update pushes those answers down, so the policy samples others and a task it never
    solves can start to give signal (https://arxiv.org/abs/2506.01347). `scores`: token-level, before any KL
    penalty."""
    seq = sequence_scores(scores)
    result = advantages.clone()
    for rows in group_rows(uid).values():
        group = seq[rows]
        if len(rows) > 1 and bool((group == group[0]).all()) and float(group[0]) <= 0.0:
            result[rows] = value * response_mask[rows]
    return result


def rloo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any]) -> torch.Tensor:
    """RLOO: A_i = s_i - mean of the OTHER rows in the group = n / (n - 1) * (s_i - mean_g).

    As verl's compute_rloo_outcome_advantage: a group of one row keeps A = s.
    """
    seq = sequence_scores(scores)
    advantages = seq.clone()
    for rows in group_rows(uid).values():
        n = len(rows)
        if n > 1:
            group = seq[rows]
            advantages[rows] = group * n / (n - 1) - group.mean() * n / (n - 1)
    return advantages.unsqueeze(-1) * response_mask


def discounted_returns(scores: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over generated tokens. A masked-out token (tool output) is skipped: its return is
    0 and the running return passes through it unchanged, so a reward after a tool call reaches the tokens before it
    (verl 0.9's compute_reinforce_plus_plus_outcome_advantage; a reward sitting on a masked token is dropped)."""
    returns = torch.zeros_like(scores)
    running = torch.zeros_like(scores[:, 0])
    for t in reversed(range(scores.shape[1])):
        mask = response_mask[:, t]
        updated = scores[:, t] + gamma * running
        returns[:, t] = updated * mask
        running = updated * mask + running * (1 - mask)
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var unbiased (verl_F.masked_whiten)."""
    count = mask.sum()
    if count < 2:
        raise ValueError("whitening needs at least 2 masked tokens (the unbiased variance divides by n - 1)")
    mean = (values * mask).sum() / count
    variance = ((values - mean) ** 2 * mask).sum() / count * (count / (count - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def reinforce_pp_advantages(scores: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted return-to-go, no baseline, whitened over
    the batch's masked tokens (verl's compute_reinforce_plus_plus_outcome_advantage)."""
    returns = discounted_returns(scores, response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any]
) -> torch.Tensor:
    """REINFORCE++ with baseline: s_i - mean_g on every token, then whitened over the batch's masked tokens.

    As verl's compute_reinforce_plus_plus_baseline_outcome_advantage: a group of one row has mean 0.
    """
    seq = sequence_scores(scores)
    centered = seq.clone()
    for rows in group_rows(uid).values():
        if len(rows) > 1:
            centered[rows] = seq[rows] - seq[rows].mean()
    per_token = centered.unsqueeze(-1).expand_as(scores) * response_mask
    return masked_whiten(per_token, response_mask) * response_mask


def kl_penalized_scores(
    scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: KLKind,
) -> torch.Tensor:
    """KL in the reward (verl's apply_kl_penalty): r_t = score_t - kl_coef * kl_t on generated tokens."""
    return scores - kl_coef * kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask


def zero_std_group_fraction(scores: torch.Tensor, uid: Sequence[Any]) -> float:
    """Fraction of groups of two or more rows whose scores are all equal: they carry no GRPO signal.

    A rising value shows collapse (every sample right, or every sample wrong). Groups of one row are left out.
    """
    seq = sequence_scores(scores)
    groups = [rows for rows in group_rows(uid).values() if len(rows) > 1]
    if not groups:
        return 0.0
    flat = sum(1 for rows in groups if bool((seq[rows] == seq[rows[0]]).all()))
    return flat / len(groups)
