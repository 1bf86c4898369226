"""The package's layers only import downward (docs/library.md, "Layout").

    math (dppo/*.py) < runtime < rewards < tasks < envs < rollout < train < studies, integrations < cli

Every `import dppo...` statement of every module counts, lazy ones inside functions included: a layer that reached
up (the rollout engine building itself from the trainer's config, say) would fail here, naming the module and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dppo

ROOT = Path(dppo.__file__).parent
RANK = {"math": 0, "runtime": 1, "rewards": 2, "tasks": 3, "envs": 4, "rollout": 5, "train": 6, "studies": 7,
        "integrations": 7, "cli": 8}
"""A module may import modules of its own layer or of a lower rank."""


def layer(module: str) -> str:
    """The layer of a dotted dppo module name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "math"  # the package itself (dppo/__init__.py)
    return parts[1] if parts[1] in RANK else "math"


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from dppo import train` names a subpackage through the package
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == "dppo"]
    return [(line, name) for line, name in found if name == "dppo" or name.startswith("dppo.")]


def upward_imports() -> list[str]:
    bad = []
    for module, path in _modules():
        own = RANK[layer(module)]
        for line, name in _imports(path):
            if RANK[layer(name)] > own:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {layer(module)} imports {name} ({layer(name)})")
    return bad


def test_no_layer_imports_a_higher_one():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The test above can fail: a lazy import of the trainer inside a rollout function is caught."""
    pkg = tmp_path / "dppo"
    (pkg / "rollout").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "__init__.py").write_text("")
    (pkg / "rollout" / "engine.py").write_text("def f():\n    from dppo.train.config import Config\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", pkg)
    assert upward_imports() == ["dppo/rollout/engine.py:2: rollout imports dppo.train.config (train)"]


@pytest.mark.parametrize("module, expected", [("dppo.losses", "math"), ("dppo.rollout.spec", "rollout"),
                                              ("dppo.runtime.models", "runtime"), ("dppo.cli", "cli"), ("dppo", "math")])
def test_layer_names(module, expected):
    assert layer(module) == expected
