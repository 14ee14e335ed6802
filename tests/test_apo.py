"""Prompt optimisation (APO): its config errors, its pieces (edits, placeholders, selection, MLflow's prompt
syntax), the room-booking example's grader, and the `optimize_prompt` flow end to end with no network: a scripted
OpenAI-compatible server (tests/support/scripted_apo.py) stands in for both the agent's model and the optimiser, and
one of the optimiser's edits (the one that says "smallest") raises the validation reward from 0.125 to 1.0."""

from __future__ import annotations

import asyncio
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.scripted_apo import GOOD_EDIT, OPTIMIZER, agent_answer, optimizer_answer, scripted_apo_app
from support.servers import serving

from examples.room_booking import agent as room_booking
from lightning import apo
from lightning.config import load_config
from lightning.errors import ConfigError
from lightning.types import PromptTemplate

SEED = "examples.room_booking.agent:INITIAL_PROMPT"


def apo_config(tmp_path: Path, url: str = "http://127.0.0.1:9", **apo_changes: Any) -> Any:
    return load_config({
        "run_name": "apo-test", "agent": "examples.room_booking.agent:room_booking",
        "train_data": "examples.room_booking.agent:train_tasks", "val_data": "examples.room_booking.agent:val_tasks",
        "inference": {"backend": "external", "endpoint": f"{url}/v1", "served_model_name": "policy"},
        "n_runners": 1, "runner_concurrency": 8,
        "sampling": {"temperature": 0.0, "max_tokens": 64}, "eval_sampling": {"temperature": 0.0, "max_tokens": 64},
        "store_url": f"sqlite:///{tmp_path}/store.db", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
        "apo": {
            "initial_prompt_from": SEED, "beam_width": 2, "branch_factor": 2, "beam_rounds": 2,
            "gradient_batch_size": 3, "val_batch_size": 8, "gradient_model": f"openai/{OPTIMIZER}",
            "apply_edit_model": f"openai/{OPTIMIZER}", "api_base": f"{url}/v1", "api_key_env": "APO_TEST_KEY",
            **apo_changes,
        },
    })  # fmt: skip


# --- configuration ---------------------------------------------------------------------------------------


def test_the_seed_prompt_is_given_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"apo: initial_prompt: give the seed prompt either as text"):
        apo_config(tmp_path, initial_prompt="Pick a room. {request} {rooms}")
    with pytest.raises(ConfigError, match=r"apo: initial_prompt: give the seed prompt either"):
        apo_config(tmp_path, initial_prompt_from=None)
    with pytest.raises(ConfigError, match=r"apo.beam_width: Input should be greater than or equal to 1"):
        apo_config(tmp_path, beam_width=0)
    with pytest.raises(ConfigError, match=r"apo.optimiser_model: unknown field"):
        apo_config(tmp_path, optimiser_model="gpt-4.1")


def test_the_flow_names_what_it_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = apo_config(tmp_path)
    monkeypatch.delenv("APO_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"apo.api_key_env: the environment variable APO_TEST_KEY"):
        apo.apo_config(config)
    with pytest.raises(ConfigError, match=r"^apo: prompt optimisation needs an `apo` section"):
        apo.apo_config(config.model_copy(update={"apo": None}))
    monkeypatch.setenv("APO_TEST_KEY", "k")
    with pytest.raises(ConfigError, match=r"^val_data: prompt optimisation scores every candidate"):
        apo.apo_config(config.model_copy(update={"val_data": None}))
    bad = apo_config(tmp_path, initial_prompt_from="examples.room_booking.agent:ROOMS")
    with pytest.raises(ConfigError, match=r"apo.initial_prompt_from: .* is a list; it must name a non-empty string"):
        bad.apo.seed()


# --- the pieces ------------------------------------------------------------------------------------------


def test_the_artifacts_show_a_prompt_without_breaking_the_page() -> None:
    """The table's prompt cell is one line, cut on a word, without backticks (cut at 197 characters, one was left
    unbalanced); the summary's code block wraps long lines."""
    from flows.optimize_prompt import CODE_WIDTH, PROMPT_CELL_CHARS, _prompt_cell, _summary_markdown

    prompt = "Pick a room for `{request}`.\n" + "Prefer the `smallest` room that fits everyone, " * 8 + "{rooms}"
    cell = _prompt_cell(prompt)
    assert len(cell) <= PROMPT_CELL_CHARS and "`" not in cell and "\n" not in cell and cell.endswith(" …")
    assert cell.startswith("Pick a room for '{request}'. Prefer the 'smallest' room")
    summary = {"rounds": 1, "reward_seed": 0.1, "reward_best": 0.9, "best_prompt": prompt, "prompt_uri": "prompts:/x/1"}
    run = SimpleNamespace(name="r", tracker=None, config=load_config({"run_name": "r"}))
    markdown = _summary_markdown(run, summary)  # type: ignore[arg-type]
    block = markdown.split("```\n")[1]
    assert max(len(line) for line in block.splitlines()) <= CODE_WIDTH
    assert " ".join(block.split()) == " ".join(prompt.split())  # wrapped, nothing lost


def test_edits_keep_the_placeholders_and_the_last_prompt_tag_wins() -> None:
    assert apo.extract_prompt("old:\n<prompt>A {x}</prompt>\nnew:\n<prompt>\n B {x} \n</prompt>") == "B {x}"
    assert apo.extract_prompt("no tags") is None and apo.extract_prompt("<prompt> </prompt>") is None
    assert apo.placeholders(PromptTemplate(template="{request} and {rooms} {{literal}}")) == {"request", "rooms"}
    assert apo.placeholders(PromptTemplate(template="{{ a }} {% if b %}{{ c.d }}{% endif %}", engine="jinja")) == {
        "a",
        "b",
        "c",
    }
    with pytest.raises(ValueError):
        apo.placeholders(PromptTemplate(template="a stray { brace"))


def test_selection_keeps_the_best_and_on_ties_the_older() -> None:
    seed = apo.candidate("seed {x}").model_copy(update={"val_reward": 0.5})
    same = apo.candidate("same {x}", parent=seed.id, round_=0).model_copy(update={"val_reward": 0.5})
    better = apo.candidate("better {x}", parent=seed.id, round_=0).model_copy(update={"val_reward": 0.9})
    failed = apo.candidate("failed {x}", parent=seed.id, round_=0).model_copy(update={"val_reward": float("nan")})
    assert [c.id for c in apo.select_beam([failed, same, seed, better], 2)] == [better.id, seed.id]
    assert apo.new_candidates([seed], [None, apo.candidate("seed {x}"), same, same]) == [same]


def test_mlflow_gets_the_template_in_its_own_syntax() -> None:
    prompt = PromptTemplate(template="Rooms: {rooms}. Literal {{braces}}. {request}")
    assert apo.mlflow_template(prompt) == "Rooms: {{rooms}}. Literal {braces}. {{request}}"
    assert apo.mlflow_template(PromptTemplate(template="{n:>4}")) == "{n:>4}"  # a format spec: kept as written
    jinja = PromptTemplate(template="{{ request }}", engine="jinja")
    assert apo.mlflow_template(jinja) == "{{ request }}"


def test_the_stand_in_answers_by_the_stated_rule() -> None:
    """The largest free room that fits, unless the prompt says "smallest"; the grader wants the smallest."""
    tasks = room_booking.train_tasks() + room_booking.val_tasks()
    assert all(room_booking.best_room(task) == task["expected_choice"] for task in tasks)
    seed = PromptTemplate(template=room_booking.INITIAL_PROMPT)

    def reward(template: PromptTemplate, task: dict[str, Any]) -> float:
        prompt = template.format(request=room_booking.describe(task), rooms=room_booking.availability(task))
        return float(room_booking.final_choice(agent_answer(prompt)) == task["expected_choice"])

    assert sum(reward(seed, task) for task in room_booking.val_tasks()) == 1  # of 8
    edited = apo.extract_prompt(optimizer_answer(f"<prompt>\n{seed.template}\n</prompt>\n<critique>\nvariant 1 of 2"))
    assert edited is not None and GOOD_EDIT in edited
    assert apo.placeholders(PromptTemplate(template=edited)) == {"request", "rooms"}
    assert all(reward(PromptTemplate(template=edited), task) == 1.0 for task in tasks)


# --- the flow, end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_optimize_prompt_raises_the_reward_and_registers_the_best_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_harness: None
) -> None:
    """Two rounds against the stand-in; the flow fails once in round 2 (an injected fault after its critiques and
    edits) and is retried by Prefect: the retry gets every finished step back from the cache, so the optimiser is
    asked nothing twice."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.optimize_prompt import optimize_prompt

    monkeypatch.setenv("APO_TEST_KEY", "sk-test")
    monkeypatch.setenv("LIGHTNING_FAULTS", "select_beam@1")
    app = scripted_apo_app()
    with serving(app) as url:
        config = apo_config(tmp_path, url)
        summary = asyncio.run(optimize_prompt.with_options(retries=1)(config))

    assert summary["reward_seed"] == 0.125 and summary["reward_best"] == 1.0
    assert GOOD_EDIT in summary["best_prompt"]
    assert (config.run_dir / "faults" / "select_beam@1").is_file()  # the fault fired, and the retry went through
    asked = [body for body in app.state.requests if body["model"] == OPTIMIZER]
    critiques = [body for body in asked if "<critique>" not in body["messages"][-1]["content"]]
    # Round 1: the seed's critique and 2 edits; round 2: a critique and 2 edits of each of the 2 prompts of the beam.
    assert (len(critiques), len(asked) - len(critiques)) == (3, 6)
    shown = r"### Run 1: reward 0\nTask: \{.*\}\n\[user\] You book meeting rooms\..*\n\[assistant\] .*final_choice: \w+"
    assert re.search(shown, critiques[0]["messages"][-1]["content"], re.DOTALL)  # a low-reward transcript, critiqued

    client = MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    prompt = client.load_prompt(summary["prompt_uri"])
    assert summary["prompt_uri"] == "prompts:/apo-test/1"
    assert prompt.to_single_brace_format() == summary["best_prompt"] and "{{request}}" in prompt.template
    assert prompt.tags["val_reward"] == "1" and prompt.tags["lightning.mlflow_run_id"] == summary["mlflow_run_id"]
    run = client.get_run(summary["mlflow_run_id"])
    assert (
        run.data.tags["apo.best_prompt"] == summary["prompt_uri"]
        and "apo-test" in run.data.tags["mlflow.linkedPrompts"]
    )
    best = client.get_metric_history(run.info.run_id, "apo.val_reward_best")
    assert [m.step for m in best] == [0, 1] and best[-1].value == 1.0 > summary["reward_seed"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "apo.val_reward_mean")] == [0, 1]
    texts = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "apo/round-00")}
    assert texts == {f"{c}.txt" for c in {apo.candidate(room_booking.INITIAL_PROMPT).id, *_edited_ids(summary)}}
    assert run.info.status == "FINISHED"

    async def table() -> list[Any]:
        async with get_client() as prefect:
            return await prefect.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["apo-test-apo"]))
            )

    # One table, updated in place each round (not a version per round), holding both rounds.
    [artifact] = asyncio.run(table())
    assert artifact.type == "table" and {row["round"] for row in json.loads(artifact.data)} == {0, 1}


def _edited_ids(summary: dict[str, Any]) -> set[str]:
    """Round 1's two edits of the seed: the good one (the best prompt) and the neutral one."""
    seed = room_booking.INITIAL_PROMPT
    head, _, last = seed.rpartition("\n\n")
    return {apo.candidate(summary["best_prompt"]).id, apo.candidate(f"{head}\n\nThink step by step. {last}").id}


@pytest.mark.slow
def test_dev_dry_runs_the_seed_prompt_and_shows_what_the_optimiser_would_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_harness: None
) -> None:
    import flows.dev
    from flows.dev import dev

    monkeypatch.setenv("APO_TEST_KEY", "sk-test")
    # A dry run draws its tasks by the clock (`iteration = int(time.time())`); at some seconds the seed prompt scored
    # 0.5 on the 8 drawn (a full run failed so): the second is fixed here, so the same 8 tasks run every time.
    monkeypatch.setattr(flows.dev, "time", types.SimpleNamespace(time=lambda: 1_800_000_000.0))
    with serving(scripted_apo_app()) as url:
        config = apo_config(tmp_path, url).model_copy(update={"batch_size": 8, "samples_per_task": 1})
        result = asyncio.run(dev(config))

    assert result["rollouts"]["succeeded"] == 8 and result["rollouts"]["reward_mean"] < 0.5  # the seed prompt's
    [worst] = result["lowest_reward"]
    assert worst["reward"] == 0.0 and worst["messages"][0]["content"].startswith("You book meeting rooms.")
    assert "final_choice:" in worst["messages"][-1]["content"]


@pytest.mark.slow
def test_the_readme_apo_commands(tmp_path: Path) -> None:
    """`python -m flows.dev examples/room_booking/apo.yaml --set batch_size=4 --set samples_per_task=1`, then
    `python -m flows.optimize_prompt examples/room_booking/apo.yaml --set apo.beam_rounds=2` (one round here), with
    OPENAI_API_KEY set and the example's models pointed at the local stand-in."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OPENAI_API_KEY": "sk-test"}
    with serving(scripted_apo_app()) as url:
        where = {
            "inference.endpoint": f"{url}/v1", "apo.api_base": f"{url}/v1", "apo.gradient_model": f"openai/{OPTIMIZER}",
            "apo.apply_edit_model": f"openai/{OPTIMIZER}", "apo.val_batch_size": 4, "apo.beam_width": 1,
            "apo.branch_factor": 1, "store_url": f"sqlite:///{tmp_path}/store.db",
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "output_dir": str(tmp_path / "runs"),
        }  # fmt: skip
        sets = [arg for name, value in where.items() for arg in ("--set", f"{name}={value}")]

        def run(flow: str, *more: str) -> dict[str, Any]:
            command = [sys.executable, "-m", f"flows.{flow}", "examples/room_booking/apo.yaml", *sets, *more]
            done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            return json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{") :])[0]

        dry = run("dev", "--set", "batch_size=4", "--set", "samples_per_task=1")
        assert dry["rollouts"]["succeeded"] == 4 and dry["lowest_reward"]
        optimised = run("optimize_prompt", "--set", "apo.beam_rounds=1")
    assert optimised["rounds"] == 1 and optimised["prompt_uri"] == "prompts:/room-booking/1"
