"""Dynamic sampling (DAPO): groups whose rewards are all equal are dropped and more tasks run until the batch has
`batch_size` groups that differ; the metrics count the flat groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning import reporting, stages
from lightning.config import load_config
from lightning.run import Run
from lightning.types import Triplet


def test_flat_groups_are_those_of_two_or_more_alike() -> None:
    rewards = {"a": [1.0, 0.0], "b": [1.0, 1.0, 1.0], "c": [0.0, 0.0], "solo": [0.0], "d": [0.5, 0.5000001]}
    assert stages.flat_groups(rewards) == {"b": 1.0, "c": 0.0}


def _triplets(rewards_by_group: dict[str, list[float]]) -> list[Triplet]:
    return [
        Triplet(prompt=[1], response=[2], reward=reward, metadata={"group_id": group, "rollout_id": f"{group}-{i}"})
        for group, rewards in rewards_by_group.items()
        for i, reward in enumerate(rewards)
    ]


def test_informative_groups_keeps_the_first_that_differ_up_to_the_limit() -> None:
    triplets = _triplets({"g1": [1, 0], "g2": [1, 1], "g3": [0, 0], "g4": [0.5, 1], "g5": [0, 1]})
    kept, dropped = stages.informative_groups(triplets, limit=2)
    assert [t.metadata["rollout_id"] for t in kept] == ["g1-0", "g1-1", "g4-0", "g4-1"]
    assert dropped == 3  # g2 and g3 flat, g5 past the limit
    kept, dropped = stages.informative_groups(triplets, limit=10)
    assert {t.metadata["group_id"] for t in kept} == {"g1", "g4", "g5"} and dropped == 2


def test_a_multi_turn_rollout_counts_once_in_its_group() -> None:
    # Two calls of rollout r0 (reward 1 on both) and one of r1 (reward 1): one reward per rollout, a flat group.
    triplets = _triplets({"g": [1.0]}) + [
        Triplet(prompt=[1], response=[2], reward=1.0, metadata={"group_id": "g", "rollout_id": "g-0"}),
        Triplet(prompt=[1], response=[2], reward=1.0, metadata={"group_id": "g", "rollout_id": "g-1"}),
        Triplet(prompt=[1], response=[2], reward=0.0, metadata={"group_id": "h", "rollout_id": "h-0"}),
        Triplet(prompt=[1], response=[2], reward=1.0, metadata={"group_id": "h", "rollout_id": "h-1"}),
    ]
    kept, dropped = stages.informative_groups(triplets, limit=4)
    assert {t.metadata["group_id"] for t in kept} == {"h"} and dropped == 1


def test_with_no_informative_group_every_triplet_stays() -> None:
    triplets = _triplets({"g1": [0, 0], "g2": [1, 1]})
    assert stages.informative_groups(triplets, limit=2) == (triplets, 0)


def test_failed_groups_are_kept_besides_the_informative_ones_up_to_their_own_limit() -> None:
    triplets = _triplets({"g1": [1, 0], "won": [1, 1], "lost1": [0, 0], "g4": [0, 1], "lost2": [0, 0], "lost3": [0, 0]})
    kept, dropped = stages.informative_groups(triplets, limit=2, failed=2)
    assert [t.metadata["group_id"] for t in kept][::2] == ["g1", "lost1", "g4", "lost2"]  # in the triplets' order
    assert dropped == 2  # "won" (flat, not failed) and lost3 (past the failed limit)
    kept, _ = stages.informative_groups(_triplets({"lost": [0, 0], "won": [1, 1]}), limit=2, failed=2)
    assert len(kept) == 4  # no group differs: every triplet stays, as without failed groups


def test_failed_groups_are_kept_only_where_they_get_an_advantage() -> None:
    demo = load_config("examples/copy_task/demo.yaml")
    assert (demo.keep_failed_groups, demo.failed_groups_kept) == (8, 8)
    # A deployment run that replaces the whole algorithm (failed_group_advantage back to 0) keeps none: they would
    # only dilute the update.
    replaced = load_config("examples/copy_task/demo.yaml", algorithm={"lr": 1e-3})
    assert (replaced.keep_failed_groups, replaced.failed_groups_kept) == (8, 0)
    load_config("examples/copy_task/demo.yaml", dynamic_sampling=False)  # no error: every group stays then
    with pytest.raises(ValueError, match="failed_group_advantage"):
        load_config("examples/copy_task/demo.yaml", **{"algorithm.failed_group_advantage": 0.5})


@pytest.mark.slow
async def test_the_rollout_phase_refills_until_enough_groups_differ(tmp_path: Path) -> None:
    config = load_config(
        {
            "run_name": "ds", "agent": "support.agents:half_flat_agent", "train_data": "support.agents:half_flat_tasks",
            "batch_size": 2, "samples_per_task": 2, "n_runners": 1, "runner_concurrency": 8,
            "dynamic_sampling": True, "max_sampling_rounds": 3,
            "store_url": f"sqlite:///{tmp_path}/store.db", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
            "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip
    run = await Run.open(config, train=False)
    try:
        rollout_ids, summary = await stages.collect_rollouts(run, 0)
        again, _ = await stages.collect_rollouts(run, 0)  # a retried iteration: the same rollouts, no new ones
    finally:
        await run.close()
    # Two of the eight tasks are mixed: the first batch of two rarely holds both, so refills ran; every refill's
    # tasks are new groups whose ids continue after the batch's.
    assert summary["refills"] >= 1 and len(set(rollout_ids)) == len(rollout_ids) == summary["rollouts"]
    assert summary["groups"] * 2 == summary["rollouts"]
    assert summary["informative_groups"] >= 2 or summary["refills"] == 3  # enough differ, or the rounds ran out
    assert again == rollout_ids
    row = reporting.iteration_row(0, summary, {"rows": 0}, {}, 1.0)
    assert row["zero_adv_groups"] == 1 - summary["informative_groups"] / summary["groups"]
    assert row["flat_group_reward"] == 1.0 and row["refills"] == summary["refills"]


def _row(share: float | None, flat_reward: float | None = None) -> dict:
    row = {"iteration": 0, "reward": 0.0, "rollouts_ok": 8, "rollouts_failed": 0, "rollout_tokens_per_s": 1.0}
    if share is not None:
        row["zero_adv_groups"] = share
    if flat_reward is not None:
        row["flat_group_reward"] = flat_reward
    return row


def test_the_progress_line_says_when_most_groups_teach_nothing_and_what_to_do() -> None:
    assert reporting.no_signal(_row(None)) is None  # no groups of two or more (evaluation, or one sample per task)
    assert reporting.no_signal(_row(0.5, 1.0)) is None
    assert reporting.no_signal(_row(0.75, 1.0)) == (
        "75% of groups scored alike (mean reward 1.000): no advantage to learn from there"
    )
    never = reporting.no_signal(_row(1.0, 0.0))
    assert never is not None and "100% of groups" in never and "warm_start" in never and "samples_per_task" in never
    solved = reporting.no_signal(_row(0.95, 1.0))
    assert solved is not None and "solves these tasks" in solved


def test_the_first_refill_is_sized_by_the_share_of_the_iteration_sure_to_be_recorded() -> None:
    from types import SimpleNamespace

    def ahead(flat_by_iteration: dict[int, float], iteration: int, staleness: int = 0, budget: int = 64) -> int:
        config = load_config({"batch_size": 32, "algorithm": {"max_staleness": staleness}})
        history = [{"iteration": i, "zero_adv_groups": flat} for i, flat in flat_by_iteration.items()]
        return stages.refill_ahead(SimpleNamespace(config=config, history=history), iteration, budget)

    # Iteration 5 reads iteration 4's share: informative share s -> 32 * (1 - s) / s more tasks, at most the budget.
    assert ahead({4: 0.2}, 5) == 8  # s = 0.8: 32 * 0.2 / 0.8
    assert ahead({4: 0.5}, 5) == 32
    assert ahead({4: 0.75}, 5) == 64  # 96, cut to the budget
    assert ahead({4: 0.75}, 5, budget=40) == 40
    assert ahead({4: 1.0}, 5) == 64  # nothing differed: the whole budget
    assert ahead({4: 0.0}, 5) == 0  # every group differed: the batch alone
    # With max_staleness 1 iteration 5 starts before 4 is recorded: it reads iteration 3; none recorded: no refill.
    assert ahead({3: 0.5, 4: 0.2}, 5, staleness=1) == 32
    assert ahead({4: 0.2}, 5, staleness=1) == 0 and ahead({}, 0) == 0
