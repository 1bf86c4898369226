"""docs/library.md's layout names every module of the tree: a module added without its line there fails here, naming
it (issue 61: the layout had fallen 14 modules behind)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("dppo", "tests", "benchmarks", "scripts")


def layout_sections() -> dict[str, str]:
    """The layout block of docs/library.md as {section: its text}: "dppo" for the top of the package, "dppo/rollout"
    for a subpackage's lines, "benchmarks", "scripts", "tests"."""
    text = (ROOT / "docs" / "library.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        head = re.match(r"^( {0,2})([\w.]+)/\s", line + " ")
        if head:
            name = head.group(2)
            current = name if head.group(1) == "" else f"dppo/{name}"
            line = line[head.end():]
        if current is not None:
            sections[current] = sections.get(current, "") + " " + line
    return sections


def named(section: str, word: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w])", section) is not None


def tree_files() -> list[str]:
    """The modules of dppo/, the benchmarks and the scripts, relative to the repository."""
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "dppo").rglob("*.py")) if p.name != "__init__.py"]
    for folder, pattern in (("benchmarks", "*.py"), ("scripts", "*")):
        files += [str(p.relative_to(ROOT)) for p in sorted((ROOT / folder).glob(pattern)) if p.is_file()]
    return files


def missing(files: list[str], sections: dict[str, str]) -> list[str]:
    """The files the layout does not name: a module of dppo/ by its name (and its subpackage's: "remote/ ... pool")
    in its subpackage's section (the top's: "dppo"); a benchmark or script by its file name in its folder's."""
    out = []
    for f in files:
        parts = Path(f).with_suffix("").parts
        if parts[0] == "dppo":
            section = "dppo" if len(parts) == 2 else f"dppo/{parts[1]}"
            words = parts[1:] if len(parts) == 2 else parts[2:]
        else:
            section, words = parts[0], (Path(f).name,)
        if not all(named(sections.get(section, ""), w) for w in words):
            out.append(f)
    return out


def test_the_layout_in_library_md_names_every_module_benchmark_and_script():
    assert missing(tree_files(), layout_sections()) == [], "docs/library.md's layout lacks a line for these"


def test_a_module_benchmark_or_script_without_its_line_is_reported():
    """The check is not vacuous: files the layout does not name are reported, those it names are not."""
    given = ["dppo/rollout/zz_unnamed.py", "dppo/rollout/hf.py", "dppo/rollout/server/zz_unnamed.py",
             "dppo/rollout/server/launch.py", "dppo/zz_unnamed.py", "dppo/divergence.py", "benchmarks/bench_zz.py",
             "benchmarks/bench_fleet.py", "scripts/zz.sh", "scripts/golden.py"]
    assert missing(given, layout_sections()) == [f for f in given if "zz" in f]
