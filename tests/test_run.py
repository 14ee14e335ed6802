"""The run as one object: stages refuse a run that is not open, a run sent to another process arrives as its
config and endpoints, and a wait that times out cancels its leftovers so no later stage runs them."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from lightning import stages
from lightning.config import TrainConfig, load_config
from lightning.run import Endpoints, Run, RunNotOpen


def small_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    data = {
        "run_name": "r",
        "batch_size": 4,
        "samples_per_task": 2,
        "n_runners": 1,
        "runner_concurrency": 8,
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }
    return load_config({**data, **changes})


async def test_a_stage_given_a_run_that_is_not_open_says_so(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    closed = Run(config=config, endpoints=Endpoints(proxy_url="http://127.0.0.1:9", model_name="policy"), queue="r")
    with pytest.raises(RunNotOpen, match=r"run 'r' is not open in this process: open it with `await Run.open"):
        await stages.update_resources(closed, "train")
    with pytest.raises(RunNotOpen):
        await stages.ppo_step(closed, 0, "batch")


@pytest.mark.slow
async def test_leftovers_of_a_timed_out_wait_are_cancelled_and_never_run_later(tmp_path: Path) -> None:
    run = await Run.open(small_config(tmp_path), train=False)
    try:
        resources_id = await stages.update_resources(run, "train")
        stranded = await stages.enqueue_rollouts(run, 0, resources_id)
        impatient = run.model_copy(update={"config": run.config.model_copy(update={"timeouts": _rollouts(0.2)})})
        summary = await stages.wait_for_rollouts(impatient, stranded)  # nobody runs them
        assert summary["cancelled"] == summary["rollouts"] == 4 * 2 and summary["succeeded"] == 0

        later, done = await stages.collect_rollouts(run, 1)
        assert done["succeeded"] == len(later) == 4 * 2
        for rollout_id in stranded:
            assert (await run.store.get_rollout_by_id(rollout_id)).status == "cancelled"
            assert await run.store.query_attempts(rollout_id) == []
        # Enqueuing iteration 0 again (a retry) hands back the cancelled rollouts; nothing runs them.
        assert await stages.enqueue_rollouts(run, 0, resources_id) == stranded
    finally:
        await run.close()


@pytest.mark.slow
async def test_a_run_sent_to_another_process_arrives_as_its_config_and_endpoints(tmp_path: Path) -> None:
    run = await Run.open(small_config(tmp_path), train=False)
    try:
        copy = pickle.loads(pickle.dumps(run))
        assert not copy.is_open and copy.config == run.config and copy.endpoints == run.endpoints
        assert copy.model_dump(mode="json")["queue"] == "r"
        async with copy.connect_store() as store:  # where the run is not open: a connection of its own
            assert store is not run.store and await store.query_rollouts(queue="r") == []
    finally:
        await run.close()
    assert not run.is_open
    with pytest.raises(RunNotOpen):
        run.store  # noqa: B018


def _rollouts(seconds: float) -> Any:
    from lightning.config import StageTimeouts

    return StageTimeouts(rollouts=seconds)
