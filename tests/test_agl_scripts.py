"""agent-lightning's training-script form, run as a script runs: tests/support/agl_calc_train.py has the shape of agl's
examples/calc_x/train_calc_agent.py (argparse, a verl config dict, `agl.VERL`, `env_var`'s helpers, an external
store, `--llm-proxy`'s tracer and adapter) with an agent of ours, imports from `lightning`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import agl_calc_train

from lightning import agl_algorithms


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """The script calls setup_logging, which takes over the `lightning` loggers; give them back."""
    yield
    for logger in (logging.getLogger("lightning"),):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def test_the_script_s_every_form_runs_up_to_fit_and_fit_says_what_this_machine_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on a machine without CUDA (test_agl_algorithms checks the check itself; torch's import costs seconds).
    monkeypatch.setattr(agl_algorithms, "verl_stack_problem", lambda: "this machine has no CUDA device")
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
    monkeypatch.delenv("AGL_MANAGED_STORE", raising=False)
    with pytest.raises(ValueError, match="AGL_MANAGED_STORE=0"):  # the script's own check, on our env_var helpers
        agl_calc_train.main(["--external-store-address", "http://127.0.0.1:9"])
    monkeypatch.setenv("AGL_MANAGED_STORE", "0")
    for argv in (["--llm-proxy", "--external-store-address", "http://127.0.0.1:9"], ["--ci-fast"]):
        with pytest.raises(RuntimeError) as refused:
            agl_calc_train.main(argv)
        assert "no CUDA device" in str(refused.value) and "trainer_backend='torch'" in str(refused.value)
    monkeypatch.setenv("AGL_CURRENT_ROLE", "runner")
    with pytest.raises(RuntimeError, match="AGL_CURRENT_ROLE=runner"):
        agl_calc_train.main(["--ci-fast", "--torch", "--model", "tiny"])


@pytest.fixture(scope="module")
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_the_script_trains_on_the_torch_trainer_with_the_proxy_s_adapter(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--torch --llm-proxy --ci-fast --model tiny`: one iteration of the `train` flow, the run's store, MLflow and
    checkpoints in the working directory, as a script run there would put them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
    summary = agl_calc_train.main(["--torch", "--llm-proxy", "--ci-fast", "--model", "tiny", "--n-runners", "1"])
    assert summary["run_name"] == "calc_x_ci" and summary["iterations"] == 1
    assert 0 <= summary["reward_before"] <= 1 and summary["checkpoint"]
    assert (tmp_path / ".lightning").is_dir()
