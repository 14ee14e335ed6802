"""How a training run reports itself: the row each iteration adds to the run's history (and MLflow's metrics), the
progress line the flow logs, the Prefect table of iterations, the closing summary, what a stopped run kept, and why an
iteration had nothing to train on or too few rollouts succeeded. The flows publish what these return."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.credentials import redact
from lightning.pipeline import STALENESS_METRICS
from lightning.run import Run
from lightning.types import AttemptedRollout


def iteration_row(
    iteration: int, rollouts: dict[str, Any], batch: dict[str, Any], metrics: dict[str, Any], rollout_seconds: float
) -> dict[str, Any]:
    """One line of the run's history (and of MLflow's metrics): reward, loss, KL, rollouts, throughput, and what
    shows a plateau coming: the share of groups with zero advantage (`zero_adv_groups`, with their mean reward
    `flat_group_reward`), the clipped share of tokens, entropy, grad norm, response length. Metrics the algorithm
    does not compute (KL without a KL term) are left out."""
    response_tokens = metrics.get("response_length_mean", 0.0) * batch["rows"]
    groups = rollouts.get("groups") or 0
    row = {
        "iteration": iteration,
        "reward": rollouts["reward_mean"],
        "rollouts_ok": rollouts["succeeded"],
        "rollouts_failed": rollouts["failed"],
        "zero_adv_groups": 1 - rollouts.get("informative_groups", 0) / groups if groups else None,
        "flat_group_reward": rollouts.get("flat_group_reward"),
        "refills": rollouts.get("refills"),
        "dropped_flat_groups": batch.get("dropped_flat_groups") or None,
        # Bounded staleness (algorithm.max_staleness >= 1): what adapt_spans did with the rollouts of older policies.
        **{name: batch.get(name) for name in STALENESS_METRICS},
        "rows": batch["rows"],
        "rollout_seconds": rollout_seconds,
        "rollout_tokens_per_s": response_tokens / rollout_seconds if rollout_seconds > 0 else 0.0,
        "train_tokens_per_s": metrics.get("tokens_per_s", 0.0),
        "pg_loss": metrics.get("pg_loss"),
        "kl": metrics.get("kl", metrics.get("kl_loss")),
        "entropy": metrics.get("entropy"),
        "clip_frac": metrics.get("clip_frac"),
        "grad_norm": metrics.get("grad_norm"),
        "response_length": metrics.get("response_length_mean"),
        "step_time_s": metrics.get("step_time_s"),
        # The train/inference mismatch: engine's vs trainer's log-probs of the sampled tokens (when the engine sent
        # them), before the update.
        "mismatch_mean": metrics.get("mismatch_mean"),
        "mismatch_max": metrics.get("mismatch_max"),
        "mismatch_frac": metrics.get("mismatch_frac"),
        # Off-policy correction: the importance weights pi_old / pi_behav of the sampled tokens.
        **{name: metrics.get(name) for name in ("is_ratio_mean", "is_ratio_max", "is_ratio_clipped_frac")},
        **_turn_metrics(batch.get("adapter")),
    }
    return {name: value for name, value in row.items() if value is not None}


def _turn_metrics(report: dict[str, Any] | None) -> dict[str, Any]:
    from lightning.adapter import AdaptReport

    return AdaptReport.model_validate(report).turn_metrics() if report else {}


def stopped_summary(run: Run, cancelled: int) -> str:
    """What a stopped run kept: its checkpoints (each with the history up to it, in MLflow too) and the rollouts
    that finished; what it cancelled, to run again when it resumes."""
    done, total = run.completed_iterations(), run.config.iterations
    kept = f"checkpoint {done} ({done} of {total} iterations trained) and " if done else ""
    return (
        f"run {run.name} stopped before finishing iteration {done}: kept {kept}every rollout that finished; "
        f"{cancelled} unfinished rollouts cancelled, to run again when it resumes"
    )


def resume_line(run_name: str, first: int, iterations: int) -> str:
    """`resuming run demo at iteration 1 (2/2)`: the iteration a resumed run starts at, numbered as the progress
    line numbers it (from 0, then its count); it said "at iteration 2 of 2" before a progress line "iteration 1"."""
    return f"resuming run {run_name} at iteration {first} ({first + 1}/{iterations})"


def progress_line(run: Run, row: dict[str, Any], done: int, elapsed: float) -> str:
    """`iteration 3 (4/40) | reward 0.412 | loss ... | 9.8 s/it | ETA 6m02s`: the iteration numbered as Prefect,
    the table and MLflow number it (from 0), how many are done, this process's rate, the rest's ETA."""
    iterations = run.config.iterations
    rate = elapsed / max(done, 1)
    left = iterations - row["iteration"] - 1
    val = f" | val {row['val_reward']:.3f}" if "val_reward" in row else ""
    kl = f" | kl {row['kl']:.4f}" if "kl" in row else ""
    mismatch = f" | mismatch {row['mismatch_mean']:.1e}" if "mismatch_mean" in row else ""
    signal = no_signal(row)
    tools = f" | turns {row['turns']:.2f}, tool use {row['tool_use']:.0%}" if "tool_use" in row else ""
    collapse = tool_use_collapse(run.history, row) if "tool_use" in row else None
    signal = "; ".join(part for part in (signal, collapse) if part)
    return (
        f"iteration {row['iteration']} ({row['iteration'] + 1}/{iterations}) | reward {row['reward']:.3f}{val} | "
        f"pg_loss {row.get('pg_loss', float('nan')):.4f}{kl}{mismatch}{tools} | rollouts {row['rollouts_ok']} ok, "
        f"{row['rollouts_failed']} failed | {row['rollout_tokens_per_s']:.0f} tok/s | {rate:.1f} s/it | "
        f"ETA {_duration(rate * left)}" + (f" | {signal}" if signal else "")
    )


def warm_start_line(step: int, steps: int, metrics: dict[str, Any], elapsed: float) -> str:
    """`warm start: step 125/375 | sft_loss 0.412 | 0.71 s/step | ETA 2m58s`: the supervised steps done, the last
    step's loss (token-mean negative log-likelihood of the demonstrations), the rate and the rest's ETA."""
    rate = elapsed / max(step, 1)
    return (
        f"warm start: step {step}/{steps} | sft_loss {metrics.get('sft_loss', float('nan')):.4f} | "
        f"{rate:.2f} s/step | ETA {_duration(rate * (steps - step))}"
    )


def warm_start_unfit(done: dict[str, Any], stop_at_loss: float | None) -> str | None:
    """A warning when a warm start with `stop_at_loss` used all its steps without fitting its demonstrations (`done`:
    what the warm start stage returned), else None: RL then starts from a policy that has not learned what they show
    (the lookup example's copying, on one seed in five: docs/benchmarks.md, "Multi-turn")."""
    if stop_at_loss is None or done.get("sft_loss", 0.0) <= stop_at_loss:
        return None
    return (
        f"warm start: its demonstrations are not fit after {done['steps']} steps (sft_loss {done['sft_loss']:.4f}, "
        f"stop_at_loss {stop_at_loss:g}); RL starts from a policy that has not learned what they show: give more "
        "warm_start.steps, or another warm_start.lr or seed"
    )


TOOL_USE_COLLAPSE = 0.5
"""The progress line warns when the share of rollouts that call a tool falls below this fraction of its peak."""


def tool_use_collapse(history: list[dict[str, Any]], row: dict[str, Any]) -> str | None:
    """A warning when tool use collapses: the share of rollouts calling a tool fell below half its peak so far (the
    failure agent-lightning's users report for multi-turn GRPO), else None."""
    before = [earlier for earlier in history if earlier["iteration"] < row["iteration"]]
    shares = [earlier["tool_use"] for earlier in before if "tool_use" in earlier]
    if "tool_use" not in row or not shares or max(shares) <= 0:
        return None
    peak = max(shares)
    if row["tool_use"] >= TOOL_USE_COLLAPSE * peak:
        return None
    return f"tool use collapsed: {row['tool_use']:.0%} of rollouts call a tool (peak {peak:.0%})"


NO_SIGNAL_SHARE = 0.5
"""Above this share of groups with zero advantage, the progress line says how much of the batch taught nothing."""


def no_signal(row: dict[str, Any]) -> str | None:
    """What the progress line says when most groups scored alike (every sample of a task got the same reward, so
    GRPO/RLOO advantages are 0 and the update learns nothing from them), and what to do about it; None otherwise."""
    share = row.get("zero_adv_groups")
    if share is None or share <= NO_SIGNAL_SHARE:
        return None
    flat_reward = row.get("flat_group_reward") or 0.0
    said = f"{share:.0%} of groups scored alike (mean reward {flat_reward:.3f}): no advantage to learn from there"
    if share < 0.9:
        return said
    if flat_reward < 0.5:
        return (
            f"{said}; the policy never earns a different reward on these tasks: give it a warm start "
            "(warm_start: demonstrations), more samples_per_task, a higher sampling temperature, or a reward with "
            "partial credit"
        )
    return f"{said}; the policy solves these tasks alike every time: harder tasks, or stop here"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Pace:
    """This process's rate of iterations, for the progress line's ETA. It is measured from the end of the first
    iteration this process ran, which carries the start-up (the first subflow, the trainer's first step): counted in,
    it made the ETA read about 10 times too long."""

    def __init__(self) -> None:
        self._since: tuple[float, int] | None = None

    def lap(self, step: int, seconds: float) -> tuple[int, float]:
        """Iteration `step - 1` is done, having taken `seconds`: (iterations, seconds) to rate by, as `progress_line`
        takes them."""
        if self._since is None:  # the first iteration's own time, the only rate there is yet
            self._since = (time.perf_counter(), step)
            return 1, seconds
        return step - self._since[1], time.perf_counter() - self._since[0]


TABLE_COLUMNS = (
    "iteration", "reward", "val_reward", "zero_adv_groups", "entropy", "clip_frac", "grad_norm", "response_length",
    "pg_loss", "kl", "rollouts_ok", "rollouts_failed", "refills", "mismatch_mean", "mismatch_max", *STALENESS_METRICS,
    "is_ratio_mean", "is_ratio_max", "is_ratio_clipped_frac", "rollout_tokens_per_s", "train_tokens_per_s",
    "rollout_seconds",
)  # fmt: skip
"""The columns of the run's table of iterations, in order; those no row has (kl without a KL term) are left out."""


def iteration_table(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's history as the flow's table of iterations (a Prefect artifact): `TABLE_COLUMNS`, numbers rounded."""
    columns = [name for name in TABLE_COLUMNS if any(name in row for row in history)]
    return [{name: _cell(row.get(name)) for name in columns} for row in history]


def _cell(value: Any) -> Any:
    """Four decimals; three significant digits below 0.001 (a mismatch of 3e-6 is not 0)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return float(f"{value:.3g}") if 0 < abs(value) < 1e-3 else round(value, 4)
    return value


def mlflow_link(run: Run) -> str:
    """Where to look in MLflow, as a Markdown link: the run's page on the tracking server, or on the local UI that
    `make mlflow-ui` (`lightning mlflow ui`) serves for a local store."""
    from lightning.metrics import LOCAL_UI, is_server, ui_command

    tracker = run.tracker
    uri = run.config.tracking_uri
    if tracker is None:
        return f"MLflow: {redact(uri)}" if is_server(uri) else f"MLflow: `{ui_command(uri)}`, then {LOCAL_UI}"
    if is_server(uri):
        return f"[MLflow run {run.name}]({tracker.run_url})"
    return f"[MLflow run {run.name}]({tracker.run_url}) (served by `{ui_command(uri)}`)"


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """`▁▃▅█`: one bar per value, scaled between the smallest and the largest (NaN: a space)."""
    finite = [v for v in values if v == v]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(" " if v != v else SPARK[round((v - low) / span * (len(SPARK) - 1))] for v in values)


def summary_markdown(run: Run, summary: dict[str, Any]) -> str:
    """The run's closing summary (a Prefect artifact): held-out rewards, the reward curve, where the weights and the
    MLflow run are."""
    rewards = [row["reward"] for row in run.history if "reward" in row]
    lines = [f"## {run.name}: {run.config.iterations} iterations", "", "| held-out reward | |", "|---|---|"]
    if run.config.warm_start is not None:
        lines.append(f"| initial (before the warm start) | {summary['reward_initial']:.3f} |")
    lines.append(f"| before training | {summary['reward_before']:.3f} |")
    lines.append(f"| after training | {summary['reward_after']:.3f} |")
    if rewards:
        lines += ["", f"Training reward by iteration: `{sparkline(rewards)}` ({rewards[0]:.3f} -> {rewards[-1]:.3f})"]
    checkpoint = summary.get("checkpoint")
    lines += ["", f"Final checkpoint: `{Path(checkpoint).resolve() if checkpoint else 'none'}`", "", mlflow_link(run)]
    return "\n".join(lines) + "\n"


def no_rows_reason(
    run: Run, iteration: int, rollouts: int, report: Any, batch_error: str, staleness: dict[str, float] | None = None
) -> str:
    """Why an iteration has nothing to train on, each cause with its fix, on one line."""
    causes = []
    if staleness and staleness.get("stale_dropped"):
        causes.append(
            f"{staleness['stale_dropped']:.0f} were sampled more than algorithm.max_staleness "
            f"{run.config.algorithm.max_staleness} policy versions before checkpoint {iteration} and dropped (up to "
            f"{staleness['staleness_max']:.0f} behind: raise max_staleness, or shorten the rollouts so they finish "
            "sooner)"
        )
    if report.rollouts_without_reward:
        causes.append(
            f"{report.rollouts_without_reward} had no reward (the agent returned None and emitted none: return a "
            "number, or call emit_reward)"
        )
    if report.rollouts_without_llm_calls:
        causes.append(
            f"{report.rollouts_without_llm_calls} made no LLM call through the run's proxy (call the LLM resource's "
            "endpoint)"
        )
    if report.calls_without_token_ids:
        causes.append(
            f"{report.calls_without_token_ids} LLM calls have no token ids (a call the agent made with its own client, "
            "not through the run's proxy, is recorded without them: give the client the LLM resource's endpoint)"
        )
    if report.failed_calls:
        causes.append(
            f"{report.failed_calls} LLM calls through the run's proxy were answered with an error, so have no tokens "
            "(the adapter's problems name the HTTP status; the agent saw the error's message: a prompt or max_tokens "
            "beyond the model's context is the usual one)"
        )
    if "'prompt_too_long': 0" not in batch_error and "prompt_too_long" in batch_error:
        causes.append(
            f"prompts longer than max_prompt_length {run.config.max_prompt_length} (raise it, or shorten them)"
        )
    return (
        f"iteration {iteration}: nothing to train on from {rollouts} rollouts: "
        + ("; ".join(causes) if causes else "see the adapter's report")
        + f" ({batch_error})"
    )


def phase_label(iteration: int, mode: str = "train") -> str:
    """A rollout phase as a person names it: `iteration 3`; held-out rollouts by the checkpoint they evaluate,
    `the held-out evaluation of checkpoint 5` (of `the initial model`: step -1, before the warm start)."""
    if mode == "train":
        return f"iteration {iteration}"
    return f"the held-out evaluation of {'the initial model' if iteration < 0 else f'checkpoint {iteration}'}"


async def rollouts_failed_reason(
    run: Run, iteration: int, rollout_ids: Sequence[str], summary: dict[str, Any], mode: str = "train"
) -> str:
    """Why a rollout phase stayed short of `min_success_fraction`: counts, how the attempts ended, and what the
    serving parts went through."""
    from lightning.diagnose import agent_errors

    rollouts = await run.store.query_rollouts(rollout_id_in=list(rollout_ids))
    endings = Counter(r.attempt.status if isinstance(r, AttemptedRollout) else "no attempt" for r in rollouts)
    errors = await agent_errors(run.store, rollout_ids)
    # The first line says why (what the agent raised first, or how the attempts ended): the command's last line.
    if errors:
        why = f"the agent raised {errors[0].split(': ', 1)[1]}"
    else:
        why = f"no agent error recorded; latest attempts {dict(endings)} (timed out, or their runners went silent)"
    more = "".join(f"\n  {line}" for line in errors)
    return (
        f"{phase_label(iteration, mode)}: {summary['succeeded']} of {summary['rollouts']} rollouts succeeded, short of "
        f"min_success_fraction {run.config.min_success_fraction:g}: {why}\n"
        f"after {run.config.rollout_retries} more round(s) for the others; latest attempts: {dict(endings)}; serving "
        f"restarts so far: {run.restarts()}"
        + (f"; the first failed rollouts (the rest in their spans):{more}" if errors else "")
    )


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) intervals: the time at least one of them was running."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total
