"""docs/testing.md's slowest-tests table, regenerated from a pytest run's `--durations` lines.

    ./test.sh -q --durations=40 -p no:cacheprovider > run.log     # the full suite, as CI runs it
    .venv/bin/python scripts/slowest_tests.py run.log [--rows 15] [--doc docs/testing.md] [--check]

The table sits between the markers `<!-- slowest:begin -->` and `<!-- slowest:end -->` of the doc and is replaced
whole: one row a test phase (call, or a fixture's setup), slowest first, with the pytest summary line and the date
above it. `--check` exits 1 when the doc's table differs from the log's (it writes nothing). Standard library only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

BEGIN, END = "<!-- slowest:begin -->", "<!-- slowest:end -->"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(call|setup|teardown)\s+(\S.*?)\s*$")
_SUMMARY = re.compile(r"^=*\s*(\d[\d,]* passed.*?in [\d.]+s(?: \([\d:]+\))?)\s*=*$")


def durations(log: str) -> list[tuple[float, str, str]]:
    """(seconds, phase, test id) of every `--durations` line of the log, in its order (pytest's: slowest first)."""
    return [(float(m.group(1)), m.group(2), m.group(3)) for m in map(_DURATION.match, log.splitlines()) if m]


def summary(log: str) -> str | None:
    """The run's closing line ("1769 passed, 2 skipped, 1 warning in 1191.92s (0:19:51)"), if the log has one."""
    found = [m.group(1) for m in map(_SUMMARY.match, log.splitlines()) if m]
    return found[-1] if found else None


def table(log: str, rows: int, day: str) -> str:
    """The markdown block that goes between the markers."""
    lines = [f"{day}, `{summary(log) or 'no summary line'}`: the {rows} slowest test phases "
             "(`scripts/slowest_tests.py`; with two workers a phase runs beside the other worker's tests).", "",
             "| s | phase | test |", "|---:|---|---|"]
    for seconds, phase, test in durations(log)[:rows]:
        lines.append(f"| {seconds:.1f} | {phase} | `{test.removeprefix('tests/')}` |")
    return "\n".join(lines)


def replace_block(doc: str, block: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the doc has no {BEGIN} ... {END} block")
    head, rest = doc.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--doc", default=str(Path(__file__).resolve().parents[1] / "docs" / "testing.md"))
    p.add_argument("--date", default=dt.date.today().isoformat())
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    log = Path(args.log).read_text(errors="replace")
    if not durations(log):
        print(f"{args.log}: no --durations lines (run pytest with --durations=N)", file=sys.stderr)
        return 2
    doc_path = Path(args.doc)
    doc = doc_path.read_text()
    new = replace_block(doc, table(log, args.rows, args.date))
    if args.check:
        return 0 if new == doc else 1
    doc_path.write_text(new)
    print(f"{doc_path}: the {min(args.rows, len(durations(log)))} slowest of {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
