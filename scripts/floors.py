"""Helper of scripts/floors.sh: the `>=` floors of dppo's direct dependencies, read from pyproject.toml.

    python scripts/floors.py constraints [EXTRA ...]   # pip constraints, `name==floor` a line ([project].dependencies
                                                       # and the named extras; default: test agents)
    python scripts/floors.py check [EXTRA ...]         # in the floors venv: the `pip freeze` line of each floored
                                                       # package; exit 1 if one is missing or not at its floor

Standard library only (tomllib; packaging where installed), so the constraints can be written by the interpreter that then
creates the venv. A requirement without a `>=` floor is left out (it floats, like the transitive dependencies).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXTRAS = ("test", "agents")
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(extras: tuple[str, ...] | list[str]) -> dict[str, str]:
    """{canonical name: floor} of [project].dependencies plus the given extras (order kept, first floor wins)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"floors.py: no extra {extra!r} in pyproject.toml (has: {', '.join(optional)})")
        reqs += optional[extra]
    out: dict[str, str] = {}
    for req in reqs:
        m = _REQ.match(req.split(";", 1)[0])
        if not m:
            raise SystemExit(f"floors.py: cannot parse requirement {req!r}")
        name, specs = _canonical(m.group(1)), m.group(2)
        for spec in specs.split(","):
            spec = spec.strip()
            if spec.startswith(">=") and name not in out:
                out[name] = spec[2:].strip()
    return out


def _same(installed: str, floor: str) -> bool:
    try:
        from packaging.version import Version
    except ImportError:  # pragma: no cover - packaging comes with the test dependencies
        return installed.split("+")[0] == floor
    # torch's local build tag (+cpu, +cu128) is not part of the floor
    return Version(Version(installed).public) == Version(floor)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("constraints", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    extras = argv[1:] or list(DEFAULT_EXTRAS)
    table = floors(extras)
    if argv[0] == "constraints":
        for name, floor in table.items():
            print(f"{name}=={floor}")
        return 0
    import subprocess

    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    installed = {}
    for line in freeze:
        if "==" in line and not line.startswith(("#", "-e")):
            installed[_canonical(line.split("==", 1)[0])] = line
    bad = 0
    for name, floor in table.items():
        line = installed.get(name)
        if line is None:
            print(f"{name}: NOT INSTALLED (floor {floor})")
            bad += 1
            continue
        ok = _same(line.split("==", 1)[1], floor)
        bad += not ok
        print(line + ("" if ok else f"   <-- NOT AT FLOOR {floor}"))
    if bad:
        print(f"floors.py: {bad} direct dependencies are not at their floors", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
