"""`dppo sanity warning`: can the ledger foresee a collapse? The held-out study of issue 52.

    dppo sanity warning PATH... [--fit-seeds 1,2] [--corpus OUT.jsonl.gz] [--json OUT.json]

PATH: `dppo sanity` out-dirs (their `<method>-seed<k>/metrics.jsonl`, every step; the group of a run is its out-dir's
name less a trailing `-a`/`-b`), or a corpus file this command wrote (`--corpus`: one JSON line per run, the metrics
the monitors and the labels read, 4 significant digits).

Protocol:
- **Labels.** A run collapsed by `dppo.studies.sanity.summary.is_collapsed` (the criterion of every `dppo sanity`
  table). Its collapse *begins* (`collapse_onset`) at the first step after the peak of its 5-step running mean of
  accuracy where that running mean has come half of the way down from the peak to the final value (a quarter was
  tried first: the running mean of a warm start at 0.99 that settles near 0.9 crossed it within 10 steps, in runs
  whose fall came hundreds of steps later).
- **Fit.** Runs whose seed is in `--fit-seeds` fix each monitor's threshold (`dppo.collapse_warning.MONITORS`): the
  one that maximises recall − false-alarm rate on them (ties: the higher threshold). The ledger rule is the ledger
  monitor with the best such score on the fit runs, chosen there too.
- **Held out.** On the other seeds only: recall = share of collapsed runs where the monitor fired before the
  collapse began; lead time = onset − first firing, in steps (median and range over the warned runs); late = fired
  at or after the onset; false-alarm rate = share of the runs that did not collapse where it fired at all.

Prints the table and a final JSON line (also written to `--json`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Sequence

from dppo import collapse_warning as cw
from dppo.studies.sanity.summary import WINDOW, is_collapsed, running_mean
from dppo.train.plot import read_metrics

KEEP = ("reward/accuracy", "reward/mean", "advantage/zero_group_frac", "mismatch/binary_tv_mean",
        "mismatch/binary_kl_mean", "policy/entropy", "trust_region/masked_frac", "optim/grad_norm")
"""Metrics a corpus keeps besides every `ledger/*` one."""
ONSET_FRACTION = 0.5


def _round(x: Any) -> Any:
    return float(f"{x:.4g}") if isinstance(x, float) and math.isfinite(x) else (None if isinstance(x, float) else x)


def load_dir(path: Path) -> list[dict[str, Any]]:
    """The runs of one `dppo sanity` out-dir: group, method, seed and rows (the kept keys). While its study runs (no
    `sanity.json` yet) a run shorter than the dir's longest is still going and is left out."""
    group = re.sub(r"-[a-z]$", "", path.name)
    runs = []
    for run_dir in sorted(path.glob("*-seed*")):
        m = re.fullmatch(r"(.+)-seed(\d+)", run_dir.name)
        if not m or not (run_dir / "metrics.jsonl").is_file():
            continue
        rows = [{k: _round(v) for k, v in r.items() if k in KEEP or k.startswith("ledger/") or k == "step"}
                for r in read_metrics(run_dir)]
        runs.append({"group": group, "method": m.group(1), "seed": int(m.group(2)), "rows": rows})
    if not runs:
        raise ValueError(f"{path}: no <method>-seed<k>/metrics.jsonl runs")
    if not (path / "sanity.json").is_file():
        longest = max(len(r["rows"]) for r in runs)
        runs = [r for r in runs if len(r["rows"]) == longest]
    return runs


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Runs from out-dirs and corpus files, in the order given."""
    runs: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if p.is_dir():
            runs += load_dir(p)
        elif p.is_file():
            with gzip.open(p, "rt") if p.suffix == ".gz" else p.open() as f:
                for n, line in enumerate(f, 1):
                    try:
                        run = json.loads(line)
                        cols = run.pop("columns")
                        run["rows"] = [dict(zip(cols, vals)) for vals in run.pop("values")]
                    except (json.JSONDecodeError, KeyError, TypeError) as exc:
                        raise ValueError(f"{p}: line {n}: not a corpus run ({exc})") from None
                    runs.append(run)
        else:
            raise FileNotFoundError(f"{p}: no such out-dir or corpus file")
    return runs


def save_corpus(runs: Sequence[dict[str, Any]], path: str | Path) -> None:
    """One JSON line per run, its rows as columns and values (what `load` reads back)."""
    with gzip.open(path, "wt") as f:
        for run in runs:
            cols = sorted({k for r in run["rows"] for k in r})
            f.write(json.dumps({**{k: v for k, v in run.items() if k != "rows"}, "columns": cols,
                                "values": [[r.get(k) for k in cols] for r in run["rows"]]}) + "\n")


def collapse_onset(rows: Sequence[dict]) -> int | None:
    """The row index where a collapsed run's collapse begins (see the module), None for a run that did not collapse."""
    if not is_collapsed(rows)[0]:
        return None
    acc = [float(r.get("reward/accuracy") or 0.0) for r in rows]
    rm = running_mean(acc)  # rm[i]: the mean of rows i .. i + WINDOW - 1
    final = sum(acc[-WINDOW:]) / len(acc[-WINDOW:])
    p = max(range(len(rm)), key=lambda i: (rm[i], -i))
    line = rm[p] - ONSET_FRACTION * (rm[p] - final)
    i = next((i for i in range(p + 1, len(rm)) if rm[i] < line), len(rm) - 1)
    return min(i + WINDOW - 1, len(acc) - 1)  # the row whose step completes that window


def labelled(runs: Sequence[dict[str, Any]], monitors: Sequence[str]) -> list[dict[str, Any]]:
    """Each run with its onset (None: stable) and every monitor's scores."""
    return [{**r, "onset": collapse_onset(r["rows"]), "scores": {m: cw.scores(r["rows"], m) for m in monitors}}
            for r in runs]


def evaluate(runs: Sequence[dict[str, Any]], monitor: str, threshold: float) -> dict[str, Any]:
    """Recall, lead times, late warnings and false alarms of `monitor` at `threshold` on labelled runs."""
    leads, late, alarms, collapsed, stable = [], 0, 0, 0, 0
    for r in runs:
        fire = cw.first_fire(r["scores"][monitor], threshold)
        if r["onset"] is None:
            stable += 1
            alarms += fire is not None
        else:
            collapsed += 1
            if fire is not None and fire < r["onset"]:
                leads.append(r["onset"] - fire)
            elif fire is not None:
                late += 1
    return {"monitor": monitor, "threshold": threshold, "collapsed": collapsed, "stable": stable,
            "warned": len(leads), "recall": len(leads) / collapsed if collapsed else None, "late": late,
            "lead_median": statistics.median(leads) if leads else None,
            "lead_min": min(leads) if leads else None, "lead_max": max(leads) if leads else None,
            "false_alarms": alarms, "false_alarm_rate": alarms / stable if stable else None}


def _useful(e: dict[str, Any]) -> float:
    return (e["recall"] or 0.0) - (e["false_alarm_rate"] or 0.0)


def fit(runs: Sequence[dict[str, Any]], monitor: str) -> dict[str, Any]:
    """The threshold of `monitor` that maximises recall − false-alarm rate on `runs` (ties: the higher one). The
    candidates are the values where a run's outcome changes: each run's highest score before its onset (or at all)."""
    cands = set()
    for r in runs:
        s = r["scores"][monitor][: r["onset"]] if r["onset"] is not None else r["scores"][monitor]
        vals = [x for x in s if x is not None]
        if vals:
            cands.add(max(vals))
    best = evaluate(runs, monitor, math.inf)
    for th in sorted(cands, reverse=True):
        e = evaluate(runs, monitor, th)
        if _useful(e) > _useful(best):
            best = e
    return best


def study(runs: Sequence[dict[str, Any]], fit_seeds: Sequence[int]) -> dict[str, Any]:
    """Fit each monitor on the fit seeds, choose the ledger rule there, and evaluate everything on the rest."""
    names = list(cw.MONITORS)
    lab = labelled(runs, names)
    fit_runs = [r for r in lab if r["seed"] in fit_seeds]
    held = [r for r in lab if r["seed"] not in fit_seeds]
    if not fit_runs or not held:
        raise ValueError(f"--fit-seeds {','.join(map(str, fit_seeds))}: leaves no fit runs or no held-out runs")
    fitted = {m: fit(fit_runs, m) for m in names}
    ledger = [m for m in names if cw.MONITORS[m][0] == "ledger"]
    rule = max(ledger, key=lambda m: (_useful(fitted[m]), -ledger.index(m)))
    return {
        "fit_seeds": sorted(fit_seeds), "rule": rule,
        "runs": {"fit": _counts(fit_runs), "held_out": _counts(held)},
        "fit": fitted,
        "held_out": {m: evaluate(held, m, fitted[m]["threshold"]) for m in names},
        "per_run": [{k: r[k] for k in ("group", "method", "seed", "onset")} | {
            "steps": len(r["rows"]), "fires": {m: cw.first_fire(r["scores"][m], fitted[m]["threshold"]) for m in names}}
            for r in lab],
    }


def _counts(runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    return {"runs": len(runs), "collapsed": sum(r["onset"] is not None for r in runs)}


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else (f"{x:{spec}}" if isinstance(x, float) else str(x))


def table(result: dict[str, Any]) -> str:
    """The held-out table: one row per monitor, the ledger rule first."""
    head = ("| monitor | kind | threshold (fit) | fit: recall / false alarms | held out: recall | lead time, median "
            "(range) | late | false-alarm rate |\n|---|---|---|---|---|---|---|---|")
    order = [result["rule"]] + [m for m in cw.MONITORS if m != result["rule"]]
    lines = [head]
    for m in order:
        f, h = result["fit"][m], result["held_out"][m]
        kind = cw.MONITORS[m][0] + (" (the rule)" if m == result["rule"] else "")
        lead = "-" if h["lead_median"] is None else f"{h['lead_median']:g} ({h['lead_min']}–{h['lead_max']})"
        lines.append(f"| {m} | {kind} | {_f(f['threshold'], '.3g')} | {_f(f['recall'])} / {_f(f['false_alarm_rate'])}"
                     f" | {_f(h['recall'])} ({h['warned']}/{h['collapsed']}) | {lead} | {h['late']} | "
                     f"{_f(h['false_alarm_rate'])} ({h['false_alarms']}/{h['stable']}) |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dppo sanity warning", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="dppo sanity out-dirs or corpus files (.jsonl.gz)")
    ap.add_argument("--fit-seeds", default="1,2", help="seeds whose runs fix the thresholds (the rest are held out)")
    ap.add_argument("--corpus", help="write the runs' kept metrics here (.jsonl.gz)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    try:
        fit_seeds = [int(s) for s in args.fit_seeds.split(",") if s.strip()]
        runs = load(args.paths)
        result = study(runs, fit_seeds)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dppo sanity warning: error: {exc}")
        return 2
    if args.corpus:
        save_corpus(runs, args.corpus)
    c = result["runs"]
    print(f"{len(runs)} runs: fit seeds {','.join(map(str, result['fit_seeds']))} ({c['fit']['runs']} runs, "
          f"{c['fit']['collapsed']} collapsed), held out {c['held_out']['runs']} runs ({c['held_out']['collapsed']} "
          f"collapsed); the ledger rule chosen on the fit runs: {result['rule']}")
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    summary = {"rule": result["rule"], "threshold": result["fit"][result["rule"]]["threshold"],
               **{f"{m}_{k}": result["held_out"][m][k] for m in cw.MONITORS
                  for k in ("recall", "lead_median", "false_alarm_rate")}}
    print(json.dumps(summary))
    return 0
