"""agent-lightning 0.3.0's public surface against ours: every module of the installed agentlightning (`make
agl-peer`) imports as `lightning.<its path>`, and every name of its `__all__`s and of `import agentlightning` is
there, unless it is refused with `NotInLightning` saying what to use instead (lightning.agl_import_paths) and listed in
docs/agent-lightning.md."""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from conftest import AGL_ENV

import lightning
from lightning.agl_import_paths import NAMES, NO_MODULE, NotInLightning, no_module_reason

SCRIPT = Path(__file__).parent / "support" / "agl_surface.py"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "agent-lightning.md"


def check_names(module: ModuleType, names: list[str], refused: set[str]) -> list[str]:
    """The problems with `names` in `module`: each must be there, or refused with its documented reason."""
    problems = []
    for name in names:
        try:
            getattr(module, name)
        except NotInLightning as exc:
            if name not in NAMES or NAMES[name] not in str(exc):
                problems.append(f"{module.__name__}.{name}: refused without its documented reason: {exc}")
            refused.add(name)
        except AttributeError:
            problems.append(f"{module.__name__}.{name}: missing (neither there nor refused)")
    return problems


@pytest.mark.agl
def test_every_public_module_and_name_of_agentlightning_resolves_or_is_a_documented_refusal(agl_python: str) -> None:
    done = subprocess.run([agl_python, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=AGL_ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    surface = json.loads(done.stdout.strip().splitlines()[-1])
    assert surface["version"] == "0.3.0" and len(surface["modules"]) > 80

    problems: list[str] = []
    refused_names: set[str] = set()
    refused_modules: set[str] = set()
    for path, names in surface["modules"].items():
        try:
            module = importlib.import_module(f"lightning.{path}")
        except NotInLightning as exc:
            reason = no_module_reason(path)
            if reason is None or reason not in str(exc):
                problems.append(f"lightning.{path}: refused without its documented reason: {exc}")
            refused_modules.add(next(p for p in NO_MODULE if path == p or path.startswith(p + ".")))
            continue
        except ImportError as exc:
            problems.append(f"lightning.{path}: {exc}")
            continue
        problems += check_names(module, names or [], refused_names)
    problems += check_names(lightning, surface["top"], refused_names)
    assert problems == []

    # Every refusal is in the porting guide, and the tables hold nothing agl does not have.
    docs = DOCS.read_text()
    assert [name for name in sorted(refused_names) if f"`{name}`" not in docs] == []
    assert [path for path in sorted(refused_modules) if f"`agentlightning.{path}`" not in docs] == []
    assert set(NO_MODULE) == refused_modules
    assert set(NAMES) <= refused_names


def test_agl_submodule_imports_of_its_examples_resolve_without_prefect() -> None:
    """What agl's docs and examples import from its submodules, checked without agl installed (make test-fast)."""
    code = """
import json, sys
from lightning.litagent import LitAgent, rollout
from lightning.reward import find_final_reward, reward
from lightning.emitter import emit_reward, find_reward_spans, is_reward_span
from lightning.adapter import TraceToMessages
from lightning.types import Dataset, Hook, NamedResources, PromptTemplate, Rollout
from lightning.store import InMemoryLightningStore, LightningStoreClient
from lightning.store.memory import InMemoryLightningStore
from lightning.tracer import AgentOpsTracer, OtelTracer, Tracer
from lightning.tracer.agentops import AgentOpsTracer
from lightning.tracer.otel import OtelTracer
from lightning.runner import LitAgentRunner
from lightning import APO, VERL, Algorithm, Trainer, algo, configure_logger, setup_logging
from lightning.algorithm import APO, VERL, Algorithm, Baseline, FastAlgorithm, algo
from lightning.algorithm.fast import Baseline
from lightning.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet
from lightning.execution import ClientServerExecutionStrategy, SharedMemoryExecutionStrategy
from lightning.llm_proxy import LLMProxy
from lightning.store import LightningStoreServer, LightningStoreThreaded
from lightning.algorithm.apo import APO
from lightning.algorithm.verl import VERL
from lightning.env_var import LightningEnvVar, resolve_bool_env_var, resolve_int_env_var, resolve_str_env_var
from lightning.logging import setup, setup_module
refused = {}
for line in ("from lightning.tracer.dummy import DummyTracer", "from lightning import LegacyAgentRunner",
             "from lightning import build_component", "from lightning.verl import AgentLightningTrainer"):
    try:
        exec(line)
    except ImportError as exc:
        refused[line] = str(exc)
layers = sorted(m for m in sys.modules if m.split(".")[0] in ("prefect", "flows", "tasks", "torch"))
print(json.dumps({"refused": refused, "layers": layers}))
"""
    done = subprocess.run(
        [__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=DOCS.parent.parent
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["layers"] == []
    assert "lightning.Tracer" in found["refused"]["from lightning.tracer.dummy import DummyTracer"]
    assert "deprecated 0.1/0.2 API" in found["refused"]["from lightning import LegacyAgentRunner"]
    assert "TrainConfig fields" in found["refused"]["from lightning import build_component"]
    assert "lightning.VERL(config)" in found["refused"]["from lightning.verl import AgentLightningTrainer"]


def test_setup_logging_takes_agl_s_arguments(tmp_path: Path) -> None:
    import logging

    script_logger = logging.getLogger("an_agl_script")
    lightning.setup_logging("DEBUG", apply_to=["an_agl_script"], files=str(tmp_path / "run.log"), color=False)
    try:
        base = logging.getLogger("lightning")
        assert base.level == logging.DEBUG and not base.propagate
        assert script_logger.handlers == base.handlers and not script_logger.propagate
        logging.getLogger("lightning.store").info("to the file")
        for handler in logging.getLogger("lightning").handlers:
            handler.flush()
        assert "to the file" in (tmp_path / "run.log").read_text()
        with pytest.raises(ValueError, match="unknown level 'LOUD'"):
            lightning.setup_logging("LOUD")
    finally:
        for logger in (logging.getLogger("lightning"), script_logger):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
                handler.close()
            logger.propagate = True
            logger.setLevel(logging.NOTSET)
