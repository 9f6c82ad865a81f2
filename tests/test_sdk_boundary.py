"""Plugins reach srv only through `srv.sdk` (and their own package)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT


def srv_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n == "srv" or n.startswith("srv.")]


def allowed(name: str, own_package: str) -> bool:
    return name == "srv.sdk" or name.startswith("srv.sdk.") or name == own_package or name.startswith(own_package + ".")


def plugin_sources() -> list[tuple[Path, str]]:
    sources = []
    for family in (ROOT / "plugins").iterdir():
        if family.is_dir():
            sources += [(p, f"srv.plugins.{family.name}") for p in family.rglob("*.py")]
    for example in (ROOT / "examples").glob("*"):
        if example.is_dir():
            sources += [(p, "") for p in example.rglob("*.py")]
    return sources


def test_plugins_import_only_the_sdk():
    sources = plugin_sources()
    assert sources, "no plugin sources found"
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path, own in sources for name in srv_imports(path)
                 if not allowed(name, own or "\0")]
    assert offenders == []


def test_the_boundary_check_catches_a_core_import(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("from srv.plugin_manager import PluginManager\nimport srv.sdk\n")
    assert [n for n in srv_imports(bad) if not allowed(n, "srv.plugins.cache")] == ["srv.plugin_manager"]


def test_plugins_doc_reference_is_generated_and_fresh():
    from srv.sdk.reference import MARKER, render_reference

    guide, _, generated = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8").partition(MARKER)
    assert guide.strip(), "the hand-written guide is missing"
    assert MARKER + generated == render_reference(), "docs/plugins.md is stale: run `make docs`"
