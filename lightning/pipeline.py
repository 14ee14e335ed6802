"""The asynchronous pipeline of a training run (`algorithm.max_staleness`): which iterations may be in flight at
once, when an iteration's rollouts may start and its update may run, and what the rollouts of older policies are
worth. With the default 0 each iteration starts after the last one's checkpoint is served; with k >= 1 iteration
i's rollouts start once iteration i-1-k is done and run while the iterations before them adapt, update and
checkpoint (docs/architecture.md, "Asynchronous RL").

The flow runs its iterations through `Pipeline` ("start an iteration", then "finish" the ones in flight), as it runs
the rollout phase through `stages.RolloutSteps`; an iteration waits for its turn (`wait_for_turn`) and, before its
update, for the checkpoint before it (`wait_for_checkpoint`); `adapt_spans` weighs or drops stale rollouts
(`drop_stale`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any

from lightning import stopping
from lightning.config import TrainConfig
from lightning.run import Run
from lightning.types import Triplet

logger = logging.getLogger(__name__)

STALENESS_METRICS = ("stale_used", "stale_corrected", "stale_dropped", "staleness_mean", "staleness_max")
"""What `drop_stale` counts, in each iteration's metrics (MLflow, the Prefect table)."""


def may_start(iteration: int, completed: int, max_staleness: int) -> bool:
    """The asynchronous loop's start rule: iteration i's rollouts start once iteration i-1-k is done (`completed`
    iterations have their checkpoints served), so they sample from a policy at most k = `max_staleness` versions
    older than the one they will update. k = 0: the synchronous loop, each iteration after the last."""
    return completed >= iteration - max_staleness


def evaluation_due(config: TrainConfig, step: int) -> bool:
    """A held-out evaluation of checkpoint `step` comes in the middle of the run (`eval_every`): the iterations before
    it finish first and none after it starts until it is done, so it measures one checkpoint."""
    return bool(config.eval_every) and step % config.eval_every == 0 and step < config.iterations


async def begin_iteration(run: Run, iteration: int) -> None:
    """The first thing iteration `iteration` does (its subflow): say it has begun (`Pipeline.start` starts the next
    one then), and with max_staleness >= 1 wait for its turn (`wait_for_turn`)."""
    run.note_iteration(iteration, "begun")
    if run.config.algorithm.max_staleness:
        await wait_for_turn(run, iteration)


async def wait_for_turn(run: Run, iteration: int, poll: float = 0.02) -> float:
    """Before iteration `iteration`'s rollouts (max_staleness k >= 1): wait until they may start (`may_start`:
    iteration i-1-k's weights are served) and the rollouts of the iteration before are in: one rollout phase at a
    time. (Two at once share the machine, end together, and leave their updates nothing to run beside: measured on
    the demo on 2 cores, iterations then ran in pairs at 0.87x the synchronous loop's speed.) The flows start an
    iteration's subflow ahead of its turn, so that Prefect's start of it (seconds, while another iteration runs) is
    not on the way. Seconds waited."""
    started = time.monotonic()
    staleness = run.config.algorithm.max_staleness
    while not (
        may_start(iteration, run.served_iterations(), staleness)
        and (run.served_iterations() >= iteration or run.iteration_reached(iteration - 1, "collected"))
    ):
        stopping.check(f"iteration {iteration} (waiting for its turn)")
        await asyncio.sleep(poll)
    return time.monotonic() - started


async def wait_for_checkpoint(run: Run, iteration: int, poll: float = 0.05) -> float:
    """Before iteration `iteration`'s update: wait until the iteration before it has checkpointed (its row is in the
    run's history, which its checkpoint stage writes once the checkpoint is saved and served), so the updates stay
    in order and each starts from the last. Seconds waited."""
    started = time.monotonic()
    while iteration > 0 and not any(row["iteration"] >= iteration - 1 for row in run.history):
        stopping.check(f"waiting for checkpoint {iteration}")
        await asyncio.sleep(poll)
    return time.monotonic() - started


class Pipeline:
    """The training iterations in flight in this process, oldest first: one at a time with max_staleness 0; with
    k >= 1, up to k + 2, each started an iteration or more ahead of its turn (Prefect takes seconds to start a subflow
    while others run; the iteration then waits in `wait_for_turn`). One starts at a time (they slow each other's
    start), and none after an evaluation's step until the iterations before it and the evaluation are done.

    `run_iteration(i)` runs iteration i (the flow's subflow) to its result; as each iteration is done, in order,
    `evaluate(step)` runs when an evaluation is due after it, then `report(i, result)`. Used as `async with`: what is
    still in flight when the block fails (an iteration failed, the run stops) is cancelled."""

    def __init__(
        self,
        run: Run,
        run_iteration: Callable[[int], Coroutine[Any, Any, dict[str, Any]]],
        evaluate: Callable[[int], Awaitable[Any]],
        report: Callable[[int, dict[str, Any]], Awaitable[None]],
        poll: float = 0.02,
    ) -> None:
        self.run = run
        self.run_iteration = run_iteration
        self.evaluate = evaluate
        self.report = report
        self.poll = poll
        self.in_flight: dict[int, asyncio.Task[dict[str, Any]]] = {}

    async def start(self, iteration: int) -> None:
        """Start iteration `iteration` once the window has room for it; meanwhile the iterations that end are
        finished (evaluated, reported), in order."""
        stopping.check(f"iteration {iteration}")
        config = self.run.config
        window = config.algorithm.max_staleness and config.algorithm.max_staleness + 1
        while self.in_flight:
            oldest, newest = min(self.in_flight), max(self.in_flight)
            if evaluation_due(config, iteration) or len(self.in_flight) > window or self.in_flight[oldest].done():
                await self._finish_oldest()
            elif self.run.iteration_reached(newest, "begun"):  # one subflow starting at a time
                break
            else:
                await asyncio.sleep(self.poll)
        self.in_flight[iteration] = asyncio.create_task(self.run_iteration(iteration))

    async def finish(self) -> None:
        """Every iteration in flight done, evaluated and reported, in order."""
        while self.in_flight:
            await self._finish_oldest()

    async def _finish_oldest(self) -> None:
        iteration = min(self.in_flight)
        result = await self.in_flight.pop(iteration)
        step = iteration + 1
        if evaluation_due(self.run.config, step):  # nothing after it is in flight (`start`): the weights are its own
            await self.evaluate(step)
        await self.report(iteration, result)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for task in self.in_flight.values():
            task.cancel()
        await asyncio.gather(*self.in_flight.values(), return_exceptions=True)
        self.in_flight.clear()


# --- the rollouts of older policies --------------------------------------------------------------------------


def sample_version(triplet: Triplet) -> int | None:
    """The oldest policy version (checkpoint step) that sampled the triplet's tokens, as the proxy recorded it on
    each LLM call's span (`weight_version`; a trajectory over several calls has `weight_versions`); None if unknown."""
    metadata = triplet.metadata or {}
    versions = metadata.get("weight_versions", [metadata.get("weight_version")])
    known = [int(version) for version in versions if isinstance(version, int | str) and str(version).isdigit()]
    return min(known) if known else None


def drop_stale(
    triplets: Sequence[Triplet], policy_version: int, max_staleness: int, corrected: bool
) -> tuple[list[Triplet], dict[str, float]]:
    """Bounded staleness (`algorithm.max_staleness`): each rollout's staleness is how many versions its oldest
    sample lags behind `policy_version`, the checkpoint the update starts from (iteration i updates checkpoint i).
    A rollout more than `max_staleness` behind is dropped; one behind by 1 to `max_staleness` is used, weighed by the
    off-policy correction when `corrected` (and it has the sampler's log-probs). The triplets kept, and each decision
    counted (`STALENESS_METRICS`): stale_used, stale_corrected, stale_dropped (rollouts), staleness_mean and
    staleness_max (over the rollouts whose version is known)."""
    from lightning.algorithm.batch import ROLLOUT_LOG_PROBS_KEY

    lag: dict[str, int] = {}
    has_log_probs: dict[str, bool] = {}
    for triplet in triplets:
        rollout = triplet.metadata["rollout_id"]
        version = sample_version(triplet)
        if version is not None:
            lag[rollout] = max(lag.get(rollout, 0), policy_version - version)
        has_log_probs[rollout] = has_log_probs.get(rollout, True) and ROLLOUT_LOG_PROBS_KEY in triplet.metadata
    dropped = {rollout for rollout, behind in lag.items() if behind > max_staleness}
    stale = [rollout for rollout, behind in lag.items() if 0 < behind <= max_staleness]
    weighed = sum(corrected and has_log_probs[rollout] for rollout in stale)
    counts = {
        "stale_used": len(stale) - weighed,
        "stale_corrected": weighed,
        "stale_dropped": len(dropped),
        "staleness_mean": sum(max(behind, 0) for behind in lag.values()) / len(lag) if lag else 0.0,
        "staleness_max": max([0, *lag.values()]),
    }
    if dropped:
        logger.warning(
            "%d rollouts sampled more than max_staleness %d versions before checkpoint %d: dropped",
            len(dropped), max_staleness, policy_version,
        )  # fmt: skip
    return [triplet for triplet in triplets if triplet.metadata["rollout_id"] not in dropped], counts
