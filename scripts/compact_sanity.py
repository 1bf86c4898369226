"""Copy a `dppo sanity` out-dir's `sanity.json` with its curves kept at every N-th step (and values rounded to 5
significant digits), so that a finished study can be committed and later merged by `dppo sanity report` (which
reads only `sanity.json`: per-seed summaries, settings and curves) on another machine.

    .venv/bin/python scripts/compact_sanity.py runs/lag4-base-a docs/data/stale-study/lag4-base-a --every 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _round(x):
    return float(f"{x:.5g}") if isinstance(x, float) else x


def compact(report: dict, every: int) -> dict:
    out = dict(report)
    out["methods"] = {}
    for name, m in report["methods"].items():
        curves = {}
        for key, c in m["curves"].items():
            keep = [i for i, s in enumerate(c["step"]) if s % every == 0 or i == 0]
            curves[key] = {k: [_round(v[i]) for i in keep] for k, v in c.items()}
        out["methods"][name] = {**m, "curves": curves}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a `dppo sanity` out-dir (holding sanity.json)")
    p.add_argument("dst", help="folder to write the compact sanity.json to")
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()
    report = json.loads((Path(args.src) / "sanity.json").read_text())
    Path(args.dst).mkdir(parents=True, exist_ok=True)
    (Path(args.dst) / "sanity.json").write_text(json.dumps(compact(report, args.every), separators=(",", ":")))
    print(f"wrote {Path(args.dst) / 'sanity.json'} ({(Path(args.dst) / 'sanity.json').stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
