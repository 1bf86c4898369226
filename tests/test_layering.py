"""The package's layers only import downward (docs/library.md, "Layout").

    math (dppo/*.py) < runtime < rewards < tasks < envs < rollout < episodes < run_files < train < studies, integrations < cli

Every `import dppo...` statement of every module counts, lazy ones inside functions and type-only ones included: a
layer that reached up (the rollout engine building itself from the trainer's config, say) would fail here, naming
the module and line. Three more rules:
- inside the math layer the modules import in the order of `MATH_TIERS` (divergence before trust_region before
  losses): a module imports only modules of a lower tier;
- no import cycle, inside a layer or across (every import statement counts, wherever it stands);
- `import dppo...` inside a function only where `LAZY_IMPORTS` lists it (file and module) with its reason: for an
  optional heavy dependency. Everything else is imported at the top of the module, where the reader sees it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dppo

ROOT = Path(dppo.__file__).parent
RANK = {"math": 0, "runtime": 1, "rewards": 2, "tasks": 3, "envs": 4, "rollout": 5, "episodes": 6, "run_files": 7,
        "train": 8, "studies": 9, "integrations": 9, "cli": 10}
"""A module may import modules of its own layer or of a lower rank."""

MATH_TIERS = (("_checks", "example", "fused_logprobs", "collapse_warning"), ("divergence", "advantages", "logprobs", "_extras"),
              ("sequence_mask", "kept_set"),
              ("trust_region", "metrics"), ("loss_spec", "ledger"), ("losses",))
"""The math layer's modules (dppo/<name>.py) in import order: each imports only modules of an earlier tier (the
package's own __init__ may import any). A new math module is added to the tier after the last one it imports."""

LAZY_IMPORTS: dict[tuple[str, str], str] = {
    # (file, module imported inside a function): why it is not at the top of the file, naming the heavy package.
    ("dppo/integrations/trl/rollout_func.py", "dppo.rollout.vllm"):
        "dppo.rollout.vllm imports vllm (optional, seconds to import) at its top; only the 'vllm' engine needs it",
    ("dppo/rewards/__init__.py", "dppo.rewards.runner"):
        "dppo.rewards.runner imports torch; reward worker processes import dppo.rewards and start without it",
}
"""The only `import dppo...` statements allowed inside a function, by (file, module imported)."""

CYCLE_EDGES_TO_BREAK: dict[tuple[str, str], str] = {}
"""Imports left out of the cycle check: each closes a cycle that is still to be broken."""


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


def _statements(path: Path) -> list[tuple[ast.stmt, bool]]:
    """Every import statement of the file, with whether it stands inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _names(node: ast.stmt) -> list[str]:
    """The dppo modules (or names) one import statement imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.module and node.level == 0:
        names = [node.module]
        # `from dppo import train` names a subpackage through the package
        names += [f"{node.module}.{a.name}" for a in node.names if node.module == "dppo"]
    else:
        names = []
    return [name for name in names if name == "dppo" or name.startswith("dppo.")]


def _imports(path: Path) -> list[tuple[int, str]]:
    return [(node.lineno, name) for node, _ in _statements(path) for name in _names(node)]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT.parent).as_posix()


def upward_imports() -> list[str]:
    bad = []
    for module, path in _modules():
        own = RANK[layer(module)]
        for line, name in _imports(path):
            if RANK[layer(name)] > own:
                bad.append(f"{_rel(path)}:{line}: {layer(module)} imports {name} ({layer(name)})")
    return bad


def math_order_violations() -> list[str]:
    """Imports inside the math layer that do not go to an earlier tier of MATH_TIERS (or modules not in it)."""
    tier = {name: i for i, names in enumerate(MATH_TIERS) for name in names}
    bad = []
    for module, path in _modules():
        if module == "dppo" or layer(module) != "math":
            continue
        name = module.split(".", 1)[1]
        if name not in tier:
            bad.append(f"{_rel(path)}: math module {name!r} is not in MATH_TIERS")
            continue
        for line, imported in _imports(path):
            other = imported.split(".")[1] if imported != "dppo" else None
            if layer(imported) == "math" and (other is None or tier.get(other, len(MATH_TIERS)) >= tier[name]):
                bad.append(f"{_rel(path)}:{line}: {name} (tier {tier[name]}) imports {imported} "
                           f"(tier {tier.get(other, '?') if other else 'package'})")
    return bad


def lazy_imports() -> list[str]:
    """`import dppo...` statements inside functions that LAZY_IMPORTS does not list."""
    bad = []
    for _, path in _modules():
        for node, in_function in _statements(path):
            for name in _names(node) if in_function else []:
                if name != "dppo" and (_rel(path), name) not in LAZY_IMPORTS:
                    bad.append(f"{_rel(path)}:{node.lineno}: imports {name} inside a function")
    return bad


def stale_entries() -> list[str]:
    """LAZY_IMPORTS / CYCLE_EDGES_TO_BREAK entries that match no import any more (hoisted: delete the entry)."""
    lazy, every = set(), set()
    for _, path in _modules():
        for node, in_function in _statements(path):
            for name in _names(node):
                every.add((_rel(path), name))
                if in_function:
                    lazy.add((_rel(path), name))
    return ([f"LAZY_IMPORTS: {k} matches no import inside a function" for k in LAZY_IMPORTS if k not in lazy]
            + [f"CYCLE_EDGES_TO_BREAK: {k} matches no import" for k in CYCLE_EDGES_TO_BREAK if k not in every])


def _graph() -> dict[str, set[str]]:
    """Module -> the dppo modules it imports (a `from m import name` counts as m, and as m.name when that is a
    module), every import statement counted, less CYCLE_EDGES_TO_BREAK."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node, _ in _statements(path):
            for name in _names(node):
                if (_rel(path), name) in CYCLE_EDGES_TO_BREAK:
                    continue
                targets = [name] + ([f"{node.module}.{a.name}" for a in node.names]
                                    if isinstance(node, ast.ImportFrom) else [])
                graph[module] |= {t for t in targets if t in modules and t != module}
    return graph


def import_cycles() -> list[str]:
    """Each import cycle (a strongly connected set of modules) as 'layer: a -> b -> a'."""
    graph, index, low, stack, on_stack, found = _graph(), {}, {}, [], set(), []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(set(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for component in found:
        path, seen = [min(component)], set()
        while path[-1] not in seen:  # walk inside the component until a module repeats: one cycle through it
            seen.add(path[-1])
            path.append(min(w for w in graph[path[-1]] if w in component))
        cycle = path[path.index(path[-1]):]
        out.append(f"{', '.join(sorted({layer(m) for m in component}))}: {' -> '.join(cycle)}")
    return sorted(out)


def test_no_layer_imports_a_higher_one():
    assert upward_imports() == []


def test_the_math_layer_imports_in_order():
    assert math_order_violations() == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_dppo_imports_inside_functions_are_on_the_allowlist():
    assert lazy_imports() == []


def test_the_allowlists_only_shrink():
    """An entry whose import was hoisted (or whose cycle was broken) is deleted, so the lists only get shorter."""
    assert stale_entries() == []


def _plant(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A fake dppo package under tmp_path with `files` (path -> source), which the checks then read."""
    pkg = tmp_path / "dppo"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for folder in [p for p in pkg.rglob("*") if p.is_dir()]:
        (folder / "__init__.py").touch()
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", pkg)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The test above can fail: a lazy import of the trainer inside a rollout function is caught."""
    _plant(tmp_path, monkeypatch, {"rollout/engine.py": "def f():\n    from dppo.train.config import Config\n"})
    assert upward_imports() == ["dppo/rollout/engine.py:2: rollout imports dppo.train.config (train)"]


def test_the_check_sees_a_function_level_import(tmp_path, monkeypatch):
    """A dppo import inside a function (here a method) that is not on the allowlist is named with its line; the
    same import at the top of the module passes."""
    source = "class A:\n    def f(self):\n        from dppo.train.config import Config\n"
    _plant(tmp_path, monkeypatch, {"train/trainer2.py": source, "train/config.py": ""})
    assert lazy_imports() == ["dppo/train/trainer2.py:3: imports dppo.train.config inside a function"]
    _plant(tmp_path, monkeypatch, {"train/trainer2.py": "from dppo.train.config import Config\n",
                                   "train/config.py": ""})
    assert lazy_imports() == []


def test_the_check_sees_a_cycle_inside_a_layer(tmp_path, monkeypatch):
    """A cycle closed by an import inside a function (invisible at import time) is found and named."""
    _plant(tmp_path, monkeypatch, {"run_files/a.py": "from dppo.run_files.b import g\n",
                                   "run_files/b.py": "def g():\n    from dppo.run_files import a\n"})
    assert import_cycles() == ["run_files: dppo.run_files.a -> dppo.run_files.b -> dppo.run_files.a"]


def test_the_check_sees_the_math_layer_out_of_order(tmp_path, monkeypatch):
    """divergence (tier 1) importing losses (tier 5) is caught, and so is a math module not in MATH_TIERS."""
    _plant(tmp_path, monkeypatch, {"divergence.py": "from dppo.losses import LOSSES\n", "losses.py": "",
                                   "newmath.py": ""})
    assert math_order_violations() == ["dppo/divergence.py:1: divergence (tier 1) imports dppo.losses (tier 5)",
                                       "dppo/newmath.py: math module 'newmath' is not in MATH_TIERS"]


def test_a_stale_allowlist_entry_is_reported(tmp_path, monkeypatch):
    """An allowlisted import that was hoisted to the module top is reported as a stale entry."""
    module = __import__(__name__, fromlist=["LAZY_IMPORTS"])
    monkeypatch.setattr(module, "LAZY_IMPORTS", {("dppo/rollout/source.py", "dppo.rollout.base"): "planted"})
    monkeypatch.setattr(module, "CYCLE_EDGES_TO_BREAK", {})
    _plant(tmp_path, monkeypatch, {"rollout/source.py": "from dppo.rollout.base import Rollout\n",
                                   "rollout/base.py": ""})
    assert stale_entries() == ["LAZY_IMPORTS: ('dppo/rollout/source.py', 'dppo.rollout.base') matches no import "
                               "inside a function"]


@pytest.mark.parametrize("module, expected", [("dppo.losses", "math"), ("dppo.rollout.spec", "rollout"),
                                              ("dppo.runtime.models", "runtime"), ("dppo.cli", "cli"), ("dppo", "math"),
                                              ("dppo.episodes.proxy", "episodes"),
                                              ("dppo.run_files.checkpoint", "run_files")])
def test_layer_names(module, expected):
    assert layer(module) == expected
