"""agent-lightning's public surface, as installed: run with agl's Python (`make agl-peer`) by
tests/test_agl_surface.py, never imported by ours. Prints one JSON object: {"modules": {module: its `__all__` or
null}, "top": the names `import agentlightning` offers that are not modules}.

Modules are found from the package's files and their `__all__` read from the source (some of agl's modules import
what is not installed: verl, poml, weave). A module or package whose name starts with `_` is private, and so are
its contents."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import agentlightning


def declared_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [str(element.value) for element in node.value.elts]  # type: ignore[attr-defined]
    return None


def main() -> None:
    root = Path(agentlightning.__file__).parent
    modules: dict[str, list[str] | None] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or any(part.startswith("_") for part in parts):
            continue
        modules[".".join(parts)] = declared_all(path)
    top = sorted(
        name
        for name in dir(agentlightning)
        if not name.startswith("_") and not isinstance(getattr(agentlightning, name), types.ModuleType)
    )
    print(json.dumps({"version": agentlightning.__version__, "modules": modules, "top": top}))


if __name__ == "__main__":
    main()
