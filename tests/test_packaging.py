"""What `pip install tianxia` brings is enough to import every module it ships.

A module-level import of a package that only the test extra installs passes the whole suite (the
tests run with that extra) and breaks `scripts/run.sh` on a fresh machine, so each third-party
import that runs when a module loads is checked against the runtime dependencies in
pyproject.toml (or, for the modules behind an extra, that extra's).
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tianxia"

# modules a user reaches only after installing an extra: the extra named here
EXTRA_MODULES = {"tianxia/ray": "ray"}


def _dist_name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def _installed_closure(names: set[str]) -> set[str]:
    """``names`` and what they require, as pip would install them here (a requirement whose
    marker is false without extras, such as one only for an extra, is not installed)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported when ``path`` loads: module-level statements, not
    function bodies, and not imports guarded by ``try/except ImportError`` (optional by design)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                caught = {n.id for h in node.handlers if h.type is not None
                          for n in ast.walk(h.type) if isinstance(n, ast.Name)}
                if not caught & {"ImportError", "ModuleNotFoundError"}:
                    visit(node.body)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return names


def test_every_module_level_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_dist_name(r) for r in project["dependencies"]}
    runtime = _installed_closure(declared)
    extras = {name: _installed_closure(declared | {_dist_name(r) for r in reqs})
              for name, reqs in project["optional-dependencies"].items()}
    provides = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names

    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).as_posix()
        allowed = next((extras[e] for prefix, e in EXTRA_MODULES.items() if rel.startswith(prefix)), runtime)
        for name in sorted(_module_level_imports(path)):
            if name in stdlib or name == "tianxia" or name.startswith("_"):
                continue
            dists = {canonicalize_name(d) for d in provides.get(name, [])}
            assert dists, f"{rel} imports {name!r}, which no installed distribution provides"
            if not dists & allowed:
                missing.append(f"{rel}: import {name} (from {', '.join(sorted(dists))})")
    assert not missing, "module-level imports that `pip install tianxia` does not bring:\n" + "\n".join(missing)
