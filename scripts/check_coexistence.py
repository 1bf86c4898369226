"""Does installing dppo into an environment people already train in change anything there? (issue: installable
beside TRL and verifiers)

    python scripts/check_coexistence.py [--rev REV] [--python python3.11] [--scenario trl|verifiers ...] [--keep DIR]

For each scenario: a fresh venv gets torch (pip install torch==<the lock's version>: the CPU wheel on this disk for
Python 3.11, PyPI's build for another Python), then what a user of that stack has (`trl`: TRL at the version dppo
supports with the newest transformers, accelerate, peft and datasets pip finds; `verifiers`: the environment hub's
package), then `pip install --dry-run --report` of dppo's wheel with the scenario's extra. It passes when pip would
change no installed package (new packages are listed, not failures). The wheel is built from the work tree, or from
git revision REV (`--rev HEAD~3` shows what an older pyproject.toml did). Needs PyPI; a few minutes a scenario.
Prints a table, then one JSON line; exit status 1 when a scenario would change a package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
VERIFIERS_VERSION = "0.4.0"
SCENARIOS = {
    # name: (what the user's environment has, dppo's extra)
    "trl": ([f"trl=={TRL_VERSION}", "transformers", "accelerate", "peft", "datasets"], "trl"),
    "verifiers": ([f"verifiers=={VERIFIERS_VERSION}"], "agents,verifiers,mcp"),
}


SHOWN = ("torch", "transformers", "accelerate", "peft", "datasets", "openai")  # listed as installed first, if present


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"check_coexistence: `{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def pip(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args])


def torch_pin() -> str:
    lock = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    return next(line for line in lock if line.lower().startswith("torch=="))


def build_wheel(rev: str | None, out: Path) -> Path:
    """dppo's wheel from the work tree or from git revision `rev` (its files as committed)."""
    source = ROOT
    if rev:
        source = out / "src"
        source.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)])
    return next(out.glob("dppo-*.whl"))


def installed(venv: Path) -> dict[str, str]:
    rows = json.loads(pip(venv, "list", "--format", "json").stdout)
    return {r["name"].lower().replace("_", "-"): r["version"] for r in rows}


def scenario(name: str, python: str, wheel: Path, work: Path) -> dict:
    stack, extra = SCENARIOS[name]
    venv = work / f"venv-{name}"
    run([python, "-m", "venv", str(venv)])
    start = time.monotonic()
    pip(venv, "install", "-q", torch_pin())
    pip(venv, "install", "-q", "-U", *stack)
    before = installed(venv)
    report = work / f"report-{name}.json"
    pip(venv, "install", "-q", "--dry-run", "--report", str(report), f"{wheel}[{extra}]")
    items = json.loads(report.read_text())["install"]
    changed, added = [], []
    for item in items:
        meta = item["metadata"]
        key = meta["name"].lower().replace("_", "-")
        if key == "dppo":
            continue
        if key in before:
            changed.append(f"{meta['name']} {before[key]} -> {meta['version']}")
        else:
            added.append(f"{meta['name']}=={meta['version']}")
    shown = [s.split("==")[0] for s in stack] + [k for k in SHOWN if k not in stack]
    return {"scenario": name, "python": python, "stack": {k: before[k] for k in shown if k in before},
            "extra": extra, "changed": changed, "added": added, "ok": not changed,
            "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=None, help="build dppo's wheel from this git revision (default: work tree)")
    parser.add_argument("--python", default="python3.11")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--keep", type=Path, default=None, help="work in DIR and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        wheel = build_wheel(args.rev, work)
        results = [scenario(name, args.python, wheel, work) for name in args.scenario or sorted(SCENARIOS)]
    print(f"dppo wheel: {wheel.name} ({'rev ' + args.rev if args.rev else 'work tree'}), {args.python}")
    print(f"{'scenario':<10} {'extra':<7} {'changed':>7} {'added':>5}  {'verdict':<8} installed first")
    for r in results:
        stack = ", ".join(f"{k} {v}" for k, v in r["stack"].items())
        print(f"{r['scenario']:<10} {r['extra']:<7} {len(r['changed']):>7} {len(r['added']):>5}  "
              f"{'ok' if r['ok'] else 'CHANGES':<8} {stack}")
        for line in r["changed"]:
            print(f"    would change {line}")
        if r["added"]:
            print(f"    would add {', '.join(r['added'])}")
    print(json.dumps({"check": "coexistence", "rev": args.rev or "worktree", "python": args.python,
                      "results": results, "ok": all(r["ok"] for r in results)}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
