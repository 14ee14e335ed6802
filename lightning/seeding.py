"""Where every sampled completion's seed comes from, so that a run's sampling depends on what it samples, not on
which requests share a batch or arrive first.

    rollout seed   = hash(run seed, mode, iteration, task index, sample index)   set when the rollout is enqueued
    call seed      = the rollout seed for the attempt's first LLM call; hash(rollout seed, turn) for turn 1, 2, ...

The rollout seed rides in the rollout's metadata (`seed`) and reaches the agent in its LLM resource's
`sampling_parameters`, which the agent passes to the OpenAI client as it passes `temperature`; the LLM proxy counts
an attempt's calls and gives each turn its own seed; the inference server (ours or vLLM) samples each choice from a
generator seeded with it. A retried attempt samples what the first one did.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 31
"""Seeds stay below 2**31: every OpenAI-compatible server takes them (vLLM seeds a torch.Generator, others an int32)."""


def _hash(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(str(part) for part in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**SEED_BITS)


def rollout_seed(run_seed: int, mode: str, iteration: int, task_index: int, sample: int) -> int:
    """The seed of one rollout of a run: distinct for every (mode, iteration, task, sample), the same on every
    resume or retry of the run."""
    return _hash("rollout", run_seed, mode, iteration, task_index, sample)


def turn_seed(seed: int, turn: int) -> int:
    """The seed of an attempt's call number `turn` (from 0) when the agent asks with `seed`: the seed itself for the
    first call, a new one for each later call (an agent that asks again with the same prompt gets a new sample)."""
    return seed if turn == 0 else _hash("turn", seed, turn)
