"""benchmarks/: every benchmark takes what it shares from `benchmarks/common.py` and none imports another.

Read from the source (ast), nothing is run: the benchmarks themselves are run by hand (docs/benchmarks.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_benchmark_imports_no_other_benchmark_and_uses_common(script):
    others = {p.stem for p in SCRIPTS} - {script.stem}
    imported = imported_modules(script)
    assert not imported & others, f"{script.name} imports {sorted(imported & others)}: share through common.py"
    assert "common" in imported, f"{script.name} does not use benchmarks/common.py (its final JSON line: common.emit)"


def test_the_check_sees_a_planted_cross_import(tmp_path):
    planted = tmp_path / "bench_x.py"
    planted.write_text("def f():\n    from bench_vs_trl import model_folder\n    return model_folder\n")
    assert "bench_vs_trl" in imported_modules(planted)
