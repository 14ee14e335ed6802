"""The `mcp` pin of the `external` and `dev` extras: LiteLLM 1.106.2 imports `mcp.types.CacheableResult` (mcp 2 only)
on any completion with tools, so the pin stays inside LiteLLM's own `mcp` range and admits no mcp 1; autogen-ext's MCP
tools (agl's calc_x agent) need mcp 1, hence the two-environment workaround in docs/agent-lightning.md."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent


def _pins(extra: str) -> dict[str, str]:
    """The extra's requirements as written, by package name."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {Requirement(line).name: line for line in extras[extra]}


def test_the_extras_pin_one_litellm_and_an_mcp_2_range() -> None:
    external, dev = _pins("external"), _pins("dev")
    assert external["litellm"] == dev["litellm"] == "litellm==1.106.2"
    assert external["mcp"] == dev["mcp"]
    mcp = Requirement(external["mcp"]).specifier
    # mcp 1.30.0 is the last 1.x: LiteLLM 1.106.2's tools path fails on it (measured; docs/agent-lightning.md).
    assert not mcp.contains("1.30.0") and not mcp.contains("1.11.0")
    assert mcp.contains("2.2.0") and mcp.contains("2.3.0")
    assert f"`{external['mcp']}`" in (REPO / "docs" / "agent-lightning.md").read_text()  # the docs name the pin


def test_the_mcp_pin_lies_inside_the_installed_litellm_s_own_mcp_range() -> None:
    try:
        declared = importlib.metadata.requires("litellm") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("litellm is not installed (the external extra)")
    [theirs] = {str(r.specifier) for r in map(Requirement, declared) if r.name == "mcp"}
    ours = Requirement(_pins("external")["mcp"]).specifier
    for version in ("1.11.0", "1.30.0", "2.0.0", "2.1.1", "2.2.0", "2.3.0", "3.0.0"):
        if ours.contains(version):
            assert Requirement(f"mcp{theirs}").specifier.contains(version), (version, theirs)


def test_the_installed_mcp_has_what_litellm_imports_for_a_call_with_tools() -> None:
    types = pytest.importorskip("mcp.types")
    assert hasattr(types, "CacheableResult")  # litellm/proxy/_experimental/mcp_server/catalog.py imports it
