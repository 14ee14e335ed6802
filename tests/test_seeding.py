"""Where sampled completions' seeds come from (lightning.seeding), and how a rollout's seed reaches its agent."""

from __future__ import annotations

from lightning.seeding import SEED_BITS, rollout_seed, turn_seed
from lightning.types import AttemptedRollout, ProxyLLM


def test_a_rollout_seed_depends_on_every_coordinate_and_nothing_else() -> None:
    seed = rollout_seed(0, "train", 3, 5, 1)
    assert seed == rollout_seed(0, "train", 3, 5, 1)  # the same on a resume, in another process
    others = {
        rollout_seed(1, "train", 3, 5, 1), rollout_seed(0, "val", 3, 5, 1), rollout_seed(0, "train", 4, 5, 1),
        rollout_seed(0, "train", 3, 6, 1), rollout_seed(0, "train", 3, 5, 2),
    }  # fmt: skip
    assert seed not in others and len(others) == 5
    assert 0 <= seed < 2**SEED_BITS


def test_the_first_turn_keeps_the_seed_and_later_turns_get_new_ones() -> None:
    assert turn_seed(77, 0) == 77
    later = [turn_seed(77, turn) for turn in range(1, 6)]
    assert len(set(later)) == 5 and 77 not in later
    assert all(0 <= seed < 2**SEED_BITS for seed in later)


def _claimed(metadata: dict) -> AttemptedRollout:
    return AttemptedRollout.model_validate(
        {
            "rollout_id": "ro-1", "input": {}, "start_time": 0.0, "status": "running", "metadata": metadata,
            "attempt": {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "start_time": 0.0},
        }
    )  # fmt: skip


def test_the_agent_gets_its_rollouts_seed_with_the_sampling_parameters() -> None:
    llm = ProxyLLM(endpoint="http://127.0.0.1:1/v1", model="policy", sampling_parameters={"temperature": 1.0})
    routed = llm.with_attempted_rollout(_claimed({"seed": 42}))
    assert routed.sampling_parameters == {"temperature": 1.0, "seed": 42}
    assert llm.sampling_parameters == {"temperature": 1.0}  # the shared resource is left as it was
    assert "seed" not in llm.with_attempted_rollout(_claimed({})).sampling_parameters
    chosen = ProxyLLM(endpoint="http://127.0.0.1:1/v1", model="policy", sampling_parameters={"seed": 7})
    assert chosen.with_attempted_rollout(_claimed({"seed": 42})).sampling_parameters == {"seed": 7}  # theirs stays
