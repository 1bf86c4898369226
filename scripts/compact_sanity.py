"""Copy a `dppo sanity` out-dir's `sanity.json` with its curves kept at every N-th step (and values rounded to 5
significant digits), so that a finished study can be committed and later merged by `dppo sanity report` (which
reads only `sanity.json`: per-seed summaries, settings and curves) on another machine.

    .venv/bin/python scripts/compact_sanity.py runs/lag4-base-a docs/data/stale-study/lag4-base-a --every 5

A study stopped before its end (the session ran out) has no `sanity.json`: `--rebuild FLAGS` makes it from the run
folders that finished (`<method>-seed<k>/metrics.jsonl` with every step), the settings from the `dppo sanity`
flags the study was started with (the same summaries and curves `dppo sanity` writes; seeds not finished are left
out; a finished study's own `sanity.json`, when there, gives the runs' seconds and the wall time — rebuilding it
brings an old study's summaries up to the current `summarize_run`):

    .venv/bin/python scripts/compact_sanity.py runs/lag4-base-a OUT --rebuild "--methods pg-is,cispo --seeds 1,2
        --steps 1000 --lr 2e-4 --sft-steps 300 --mismatch lag:4"
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


def rebuild(src: Path, flags: str) -> dict:
    """The `sanity.json` report of the finished runs in `src`, for the study of the `dppo sanity` flags `flags`."""
    import shlex

    from dppo.studies.sanity.config import parse_args
    from dppo.studies.sanity.methods import method_loss, run_name
    from dppo.studies.sanity.run import study_settings
    from dppo.studies.sanity.summary import CRITERIA, CURVE_KEYS, curves, summarize_method, summarize_run
    from dppo.train.plot import read_metrics

    study = parse_args(shlex.split(flags) + ["--out-dir", str(src)]).resolve()
    warm = sorted(src.glob("warm-*"))
    old = json.loads((src / "sanity.json").read_text()) if (src / "sanity.json").is_file() else {"methods": {}}
    seconds = {(name, p.get("seed")): p.get("seconds") for name, m in old["methods"].items() for p in m["per_seed"]}
    methods = {}
    for method in study.methods:
        per_seed, runs = [], []
        for seed in study.seeds:
            run_dir = src / f"{run_name(method)}-seed{seed}"
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
            if len(rows) < study.steps:
                continue
            evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()] \
                if (run_dir / "eval.jsonl").is_file() else []
            per_seed.append({**summarize_run(rows), "seed": seed, "seconds": seconds.get((method, seed)),
                             "run_dir": str(run_dir), "eval_pass@1": evals[-1].get("pass@1") if evals else None})
            runs.append(rows)
        if per_seed:
            methods[method] = {"loss": {k: ("inf" if v == float("inf") else v) for k, v in method_loss(method).items()},
                               "summary": summarize_method(per_seed), "per_seed": per_seed,
                               "curves": {key: curves(runs, key) for key, _ in CURVE_KEYS}}
    return {"settings": study_settings(study, warm[0] if warm else src), "criteria": dict(CRITERIA),
            "methods": methods, "wall_s": old.get("wall_s", 0.0), "rebuilt_from_run_folders": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a `dppo sanity` out-dir (holding sanity.json)")
    p.add_argument("dst", help="folder to write the compact sanity.json to")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rebuild", default=None, metavar="FLAGS",
                   help="make the report from the finished run folders, for the study of these `dppo sanity` flags")
    args = p.parse_args()
    if args.rebuild is not None:
        report = rebuild(Path(args.src), args.rebuild)
    else:
        report = json.loads((Path(args.src) / "sanity.json").read_text())
    Path(args.dst).mkdir(parents=True, exist_ok=True)
    (Path(args.dst) / "sanity.json").write_text(json.dumps(compact(report, args.every), separators=(",", ":")))
    print(f"wrote {Path(args.dst) / 'sanity.json'} ({(Path(args.dst) / 'sanity.json').stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
