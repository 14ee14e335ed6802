"""What the import contracts (`lint-imports`, [tool.importlinter] in pyproject.toml) cannot see: loading a config
needs neither torch nor transformers, `tasks`, `flows` and `deployments` resolve to this project's packages whatever
else is installed (verl's wheel once shipped a top-level `tests`), and no module of ours hides the standard
library's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_after(code: str) -> dict[str, object]:
    """Run `code` in a fresh interpreter and report what it left in sys.modules (as JSON)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_a_config_imports_neither_torch_nor_transformers() -> None:
    found = imported_after(
        "import json, sys\n"
        "from lightning.config import load_config\n"
        "load_config('examples/copy_task/demo.yaml')\n"
        "heavy = ('torch', 'transformers', 'mlflow', 'prefect')\n"
        "print(json.dumps({'heavy': sorted(m for m in heavy if m in sys.modules)}))\n"
    )
    assert found["heavy"] == []


def test_the_top_level_packages_are_this_project_s() -> None:
    found = imported_after(
        "import json, deployments, flows, tasks, lightning\n"
        "print(json.dumps({m.__name__: m.__file__ for m in (deployments, flows, tasks, lightning)}))\n"
    )
    for name, path in found.items():
        assert Path(path).resolve() == REPO / name / "__init__.py", (name, path)
    # And from another directory, as an installed package (a worker's flow run starts in a temporary directory).
    elsewhere = subprocess.run(
        [sys.executable, "-c", "import tasks, flows; print(tasks.__file__); print(flows.__file__)"],
        cwd="/", capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert [Path(line).resolve() for line in elsewhere.stdout.split()] == [
        REPO / "tasks" / "__init__.py",
        REPO / "flows" / "__init__.py",
    ]


def test_no_module_of_ours_shadows_the_standard_library() -> None:
    """A worker runs a flow with its entrypoint's folder on sys.path, so `flows/secrets.py` once stood in for the
    standard `secrets` module in every process the flow spawned (the trainer died on start)."""
    ours = {
        path.stem
        for folder in ("flows", "tasks", "deployments", "examples", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
    } | {path.name for path in (REPO / "lightning").rglob("*") if path.is_dir()}
    shadowing = sorted(ours & set(sys.stdlib_module_names))
    assert shadowing == [], f"rename these modules, they hide the standard library's: {shadowing}"
