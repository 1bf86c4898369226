"""`dppo sanity report`: the stability study's tables from finished runs, a mismatch run beside its control.

    dppo sanity report DIR [DIR ...] [--control DIR [DIR ...]] [--parts 4] [--baseline METHOD] [--split]
        [--plot PATH] [--json PATH]

A long study is often run as several `dppo sanity` processes (a few methods each, on separate cores), and its
no-mismatch control as another. This reads their `sanity.json` files, merges the methods of the DIRs into one
study (and those of the `--control` DIRs into another), and prints one markdown row per method:

- control: final training accuracy (mean over seeds), seeds ending >= 0.95 and collapsed seeds, when a control is
  given;
- the study: final accuracy (min–max over seeds), collapsed seeds, each seed's final accuracy in seed order (✗ =
  collapsed, `is_collapsed`), peak accuracy (the best 5-step running mean, mean over seeds), and the number of seeds
  whose final accuracy is >= 0.95;
- **mismatch by part**: the seed-mean of `mismatch/binary_tv_mean` (mean |π − µ| at the start of a step) averaged
  over each of `--parts` equal spans of the run, first → last: a mismatch that grows with the policy shows as a
  rising sequence (Fig. 3 of the paper), a trust region that holds it shows as a flat or falling one;
- max mismatch (largest step value over seeds) and the mean masked fraction; **masked Â>0 / Â<0**: the masked share
  of the tokens with a positive / negative advantage (`trust_region/masked_frac_pos`/`_neg`: the learning signal a
  trust region removes; zero-advantage tokens carry none; "-" for files written before it);
- **drop → recovery**: the seed-mean trough (lowest 5-step running mean of the accuracy in the first 100 steps, the
  drop a stale engine causes) and the seed-mean share of the way from it back to 95% the final accuracy went
  (`dppo.studies.sanity.summary.trough_and_recovery`; "-" for files written before it);
- **masked by staleness**: the masked share at the version lag that trained most steps (the lag K of a stale engine;
  `masked_by_staleness`), and with `--split` the mismatch split's columns (mean |π_old − µ|, mean |π − π_old|, the
  masked share attributed to each factor) and the sequence mask's removed shares;
- with `--baseline METHOD`, **Δ vs METHOD**: the mean over the seeds both ran of (this method's final accuracy −
  METHOD's), ± its standard error (sample standard deviation / √n): seeds share the data order and the first
  rollouts, so the paired difference is less noisy than the two means' (`paired_difference`).

A method found in several DIRs with disjoint seeds (more seeds run later, or in parallel) is merged: its per-seed
summaries are pooled and its curves combined. Merging refuses studies whose settings differ in anything but the
methods, seeds, out-dir and warm-start folder (`IGNORED_KEYS`: a study's methods must share the model, lr, batch,
steps and mismatch; only the loss differs), and a (method, seed) that appears twice. The control must match the
study's settings except the mismatch source. It reads `sanity.json` files written before and after the study's
settings became `SanityConfig`. Everything here reads the summaries and curves `dppo sanity` wrote; nothing is
trained.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from dppo.studies.sanity.summary import fmt as _f, plot_sanity, summarize_method

MISMATCH_KEYS = ("engine_dtype", "logit_noise", "quantization", "engine_lag")
"""Settings that name the mismatch source: the only ones a control may differ in."""
IGNORED_KEYS = ("seeds", "warm_start", "methods", "out_dir", "threads", "quick", "mismatch", "digits", "min_len",
                "max_len")
"""Settings merged studies may differ in, or that other settings stand for: each DIR runs its own methods and seeds
in its own out-dir (the warm start is cached there), `threads` sets only the speed, `quick` and `mismatch` are
recorded resolved into the fields they set, and the task's options are compared as `task_options` (files written
before `SanityConfig` record `digits` only, and neither `methods`, `out_dir`, `threads`, `quick` nor `mismatch`)."""
ADDED_KEYS = {"env": "none", "max_turns": 3, "split_mismatch": False}
"""Settings added after the first studies were written, with the value a file without them stands for (single-turn
studies: no environment; max_turns only matters with one; no logged mismatch split)."""
TARGET_FINAL = 0.95
"""The issue's accuracy bar for a stable method (training accuracy, last 5 steps)."""


def load_study(dirs: Sequence[str | Path]) -> dict[str, Any]:
    """Merge the `sanity.json` of each folder in `dirs` into {"settings", "methods", "wall_s", "dirs"}.
    A method in several folders has its seeds pooled (`merge_seeds`). ValueError (naming the folder and the field)
    when a file is missing, the settings differ beyond `IGNORED_KEYS`, or a (method, seed) is in two folders."""
    if not dirs:
        raise ValueError("no study folders given")
    settings: dict[str, Any] | None = None
    methods: dict[str, Any] = {}
    wall, first = [], None
    for d in dirs:
        path = Path(d) / "sanity.json"
        if not path.is_file():
            raise ValueError(f"{path}: no such file (run `dppo sanity --out-dir {d}` first)")
        report = json.loads(path.read_text())
        these = {**ADDED_KEYS, **{k: v for k, v in report["settings"].items() if k not in IGNORED_KEYS}}
        if these["env"] == "none":
            these.pop("max_turns")
        if settings is None:
            settings, first = these, path
        else:
            for key in sorted(set(settings) | set(these)):
                if settings.get(key) != these.get(key):
                    raise ValueError(f"{path}: setting {key!r} is {these.get(key)!r}, but {first} has "
                                     f"{settings.get(key)!r}; merged studies must differ only in the loss")
        for name, m in report["methods"].items():
            methods[name] = m if name not in methods else merge_seeds(methods[name], m, where=f"{path}: {name!r}")
        wall.append(float(report.get("wall_s", 0.0)))
    return {"settings": settings, "methods": methods, "wall_s": wall, "dirs": [str(d) for d in dirs]}


def _merge_curve(a: dict[str, list], na: int, b: dict[str, list], nb: int) -> dict[str, list]:
    """The seed-mean/min/max curve of na + nb seeds from the curves of na and of nb seeds (steps present in both)."""
    ib = {s: i for i, s in enumerate(b.get("step", []))}
    out: dict[str, list] = {"step": [], "mean": [], "min": [], "max": []}
    for i, step in enumerate(a.get("step", [])):
        j = ib.get(step)
        if j is None:
            continue
        out["step"].append(step)
        out["mean"].append((na * a["mean"][i] + nb * b["mean"][j]) / (na + nb))
        out["min"].append(min(a["min"][i], b["min"][j]))
        out["max"].append(max(a["max"][i], b["max"][j]))
    return out


def merge_seeds(a: dict[str, Any], b: dict[str, Any], *, where: str = "") -> dict[str, Any]:
    """One method's results from two folders that ran disjoint seeds: per-seed summaries concatenated, the
    method summary recomputed (`summarize_method`), the curves combined (seed-weighted means). ValueError when a
    seed is in both or the loss sections differ."""
    seeds_a = {p.get("seed") for p in a["per_seed"]}
    both = sorted(seeds_a & {p.get("seed") for p in b["per_seed"]})
    if both:
        raise ValueError(f"{where}: seeds {both} are also in an earlier folder")
    if a.get("loss") != b.get("loss"):
        raise ValueError(f"{where}: loss {b.get('loss')} differs from the earlier folder's {a.get('loss')}")
    na, nb = len(a["per_seed"]), len(b["per_seed"])
    per_seed = a["per_seed"] + b["per_seed"]
    curves = {k: _merge_curve(a["curves"][k], na, b["curves"][k], nb) for k in a["curves"] if k in b["curves"]}
    return {**a, "summary": summarize_method(per_seed), "per_seed": per_seed, "curves": curves}


def check_control(study: dict[str, Any], control: dict[str, Any]) -> None:
    """ValueError naming the field when the control differs from the study in more than the mismatch source."""
    for key in sorted(set(study["settings"]) | set(control["settings"])):
        if key in MISMATCH_KEYS:
            continue
        if study["settings"].get(key) != control["settings"].get(key):
            raise ValueError(f"control: setting {key!r} is {control['settings'].get(key)!r}, the study's is "
                             f"{study['settings'].get(key)!r}; a control differs only in the mismatch source")


def mismatch_by_part(curve: dict[str, list], parts: int = 4) -> list[float]:
    """The seed-mean curve's values averaged over `parts` equal consecutive spans of its steps (the last span takes
    the remainder). ValueError when there are fewer steps than parts."""
    values = curve.get("mean") or []
    if parts < 1 or len(values) < parts:
        raise ValueError(f"parts: need 1 <= parts <= steps ({len(values)}), got {parts}")
    size = len(values) // parts
    bounds = [i * size for i in range(parts)] + [len(values)]
    return [sum(values[a:b]) / (b - a) for a, b in zip(bounds[:-1], bounds[1:])]


def method_row(m: dict[str, Any], parts: int = 4) -> dict[str, Any]:
    """The numbers of one method's report row (see the module docstring)."""
    s, per_seed = m["summary"], m["per_seed"]
    finals = [p["final_accuracy"] for p in per_seed if p.get("final_accuracy") is not None]
    peaks = [p.get("peak_accuracy") for p in per_seed if p.get("peak_accuracy") is not None]
    curve = m["curves"].get("mismatch/binary_tv_mean") or {}
    return {
        "final": s["final_accuracy"], "min": s["final_accuracy_min"], "max": s["final_accuracy_max"],
        "collapsed": s["collapsed"], "seeds": s["seeds"],
        "peak": sum(peaks) / len(peaks) if peaks else None,
        "at_target": sum(f >= TARGET_FINAL for f in finals),
        "per_seed": [(p.get("seed"), p.get("final_accuracy"), bool(p.get("collapsed"))) for p in per_seed],
        "mismatch_parts": mismatch_by_part(curve, parts) if len(curve.get("mean") or []) >= parts else [],
        "max_mismatch": s["max_mismatch"], "masked": s["masked_frac"],
        "trough": s.get("trough_accuracy"), "recovery": s.get("recovery"),
        "masked_by_staleness": s.get("masked_by_staleness") or {},
        **{k: s.get(k) for k in ("seq_removed_pos", "seq_removed_neg", "old_rollout_tv", "current_old_tv",
                                 "masked_from_mismatch", "masked_from_update", "masked_pos", "masked_neg")},
    }


def paired_difference(study: dict[str, Any], name: str, baseline: str) -> tuple[float, float | None, int] | None:
    """(mean, standard error, n) over the seeds both `name` and `baseline` ran of the difference in final accuracy
    (`name` − `baseline`); the error is None for one seed, the result None for no shared seed."""

    def finals(m: str) -> dict[Any, float]:
        return {p.get("seed"): p["final_accuracy"] for p in study["methods"][m]["per_seed"]
                if p.get("final_accuracy") is not None}

    a, b = finals(name), finals(baseline)
    diffs = [a[k] - b[k] for k in a if k in b]
    if not diffs:
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.fmean(diffs), se, len(diffs)


def _paired(x: tuple[float, float | None, int] | None) -> str:
    if x is None:
        return "-"
    mean, se, n = x
    return f"{mean:+.3f}" + ("" if se is None else f" ± {se:.3f}") + f" ({n})"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _at_lag(by_tau: dict[str, float]) -> str:
    """The masked share at the largest staleness logged (the stale engine's lag), e.g. "τ4 3.9%"."""
    if not by_tau:
        return "-"
    tau = max(by_tau, key=int)
    return f"τ{tau} {_pct(by_tau[tau])}"


def report_table(study: dict[str, Any], control: dict[str, Any] | None = None, parts: int = 4,
                 split: bool = False, baseline: str | None = None) -> str:
    """The markdown table of `study` (merged by `load_study`), with the control's columns when given, the
    sequence-mask and mismatch-split columns with `split`, and the paired difference to `baseline` when given."""
    head = ["method"]
    if control is not None:
        head += ["control: final acc", f"≥ {TARGET_FINAL}", "collapsed"]
    head += ["final acc (min–max)", "collapsed", "per seed (✗ collapsed)", "peak", f"≥ {TARGET_FINAL}",
             f"mismatch by {'quarter' if parts == 4 else 'part'}", "max", "masked", "masked Â>0 / Â<0",
             "drop → recovery", "masked by staleness"]
    if baseline is not None:
        if baseline not in study["methods"]:
            raise ValueError(f"--baseline {baseline!r} is not a method of the study (it has: "
                             f"{', '.join(study['methods'])})")
        head += [f"Δ vs {baseline} (± SE, seeds)"]
    if split:
        head += ["seq removed Â>0 / Â<0", "|π_old−µ|", "|π−π_old|", "masked: mismatch / update"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in study["methods"].items():
        r = method_row(m, parts)
        cells = [name]
        if control is not None:
            c = control["methods"].get(name)
            rc = None if c is None else method_row(c, 1)
            cells += ["-", "-", "-"] if rc is None else [_f(rc["final"]), f"{rc['at_target']}/{rc['seeds']}",
                                                        f"{rc['collapsed']}/{rc['seeds']}"]
        seeds = " ".join(f"{_f(final, '.2f')}{'✗' if dead else ''}" for _, final, dead in sorted(
            r["per_seed"], key=lambda x: (x[0] is None, x[0])))
        cells += [f"{_f(r['final'])} ({_f(r['min'], '.2f')}–{_f(r['max'], '.2f')})", f"{r['collapsed']}/{r['seeds']}",
                  seeds, _f(r["peak"]), f"{r['at_target']}/{r['seeds']}",
                  " → ".join(_f(x) for x in r["mismatch_parts"]) or "-", _f(r["max_mismatch"], ".2f"),
                  _pct(r["masked"]), f"{_pct(r['masked_pos'])} / {_pct(r['masked_neg'])}",
                  "-" if r["trough"] is None else f"{_f(r['trough'], '.2f')} → {_f(r['recovery'], '.2f')}",
                  _at_lag(r["masked_by_staleness"])]
        if baseline is not None:
            cells.append("-" if name == baseline else _paired(paired_difference(study, name, baseline)))
        if split:
            cells += [f"{_pct(r['seq_removed_pos'])} / {_pct(r['seq_removed_neg'])}", _f(r["old_rollout_tv"], ".4f"),
                      _f(r["current_old_tv"], ".4f"),
                      f"{_pct(r['masked_from_mismatch'])} / {_pct(r['masked_from_update'])}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dppo sanity report", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="out-dirs of `dppo sanity` runs, merged into one study")
    p.add_argument("--control", nargs="+", default=None, help="out-dirs of the no-mismatch control, merged")
    p.add_argument("--parts", type=int, default=4, help="spans the mismatch curve is averaged over")
    p.add_argument("--plot", default=None, help="write the merged study's curves (sanity.png layout) here")
    p.add_argument("--json", default=None, help="write the rows (and the merged settings) here as JSON")
    p.add_argument("--baseline", default=None, metavar="METHOD",
                   help="add each method's final accuracy minus METHOD's, paired by seed, ± its standard error")
    p.add_argument("--split", action="store_true",
                   help="add the sequence mask's removed shares and the mismatch split's columns")
    return p


def cmd_report(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        study = load_study(args.dirs)
        control = load_study(args.control) if args.control else None
        if control is not None:
            check_control(study, control)
        table = report_table(study, control, args.parts, args.split, args.baseline)
    except ValueError as exc:
        print(f"dppo sanity report: error: {exc}")
        return 2
    s = study["settings"]
    env = "" if s.get("env", "none") == "none" else f" in the {s['env']} environment ({s.get('max_turns')} turns)"
    print(f"{s['task']}{env}, {s['steps']} steps, {s.get('prompts_per_step', 32)} x {s.get('group_size', 8)} "
          f"per step, lr {s['lr']}, warm start {s['sft_steps']} SFT steps, engine "
          f"{s['engine_dtype']} lag {s['engine_lag']} quantization {s['quantization']} noise {s['logit_noise']}; "
          f"wall {' + '.join(f'{w:.0f}' for w in study['wall_s'])} s")
    print(table)
    if args.plot:
        print(f"[sanity report] wrote {plot_sanity(study['methods'], args.plot)}")
    if args.json:
        rows = {name: method_row(m, args.parts) for name, m in study["methods"].items()}
        Path(args.json).write_text(json.dumps({"settings": s, "dirs": study["dirs"], "rows": rows}, indent=1))
        print(f"[sanity report] wrote {args.json}")
    return 0
