"""What a study reports: per-run and per-method summaries, collapse detection, the printed table and Fig. 3's curves.

Summary per run (`summarize_run`, from the run's `metrics.jsonl` rows):
- final accuracy: mean `reward/accuracy` of the last 5 steps;
- steps to 90%: first step whose `reward/accuracy` ≥ 0.9 ("-" if never);
- start / max / final mismatch: first-5-step mean, max and last-5-step mean of `mismatch/binary_tv_mean` (mean
  |π−µ| at the start of a step; final well above start = the mismatch drifted up);
- masked fraction: mean of `trust_region/masked_frac` over steps, and per staleness τ (the version lag of the trained
  responses) the mean of `trust_region/masked_frac_stale_τ` over the steps that trained responses of that lag;
- trough and recovery: the lowest 5-step running mean of the accuracy in the first 100 steps (the initial drop a
  stale engine causes) and how much of the way from it back to 95% the final accuracy went,
  (final − trough) / (0.95 − trough) (1 = back at 95%, 0 = no better than the trough; none when the trough is
  ≥ 0.95);
- when logged, the mean share of responses the sequence mask removed (Â > 0 / Â < 0) and the mismatch split
  (mean |π_old − µ|, mean |π − π_old|, the masked share attributed to each);
- **collapsed** (`is_collapsed`): yes when (a) the final accuracy is below half of the run's peak accuracy
  (peak of the 5-step running mean over full windows) and the peak is at least 0.05 above the final value, or (b)
  for 5 consecutive steps every group had zero advantage while accuracy was below 0.5 and the run ended below 0.5
  (all-wrong groups: no gradient ever again; under a stale engine the engine's older weights can bring a gradient
  back, and a run that then climbs above 0.5 is not counted). Per method, the table reports how many seeds collapsed.

Per method (`summarize_method`) the means over seeds, the min–max of the final accuracy and the median steps to
90% over the seeds that reached it. `sanity.png` (`plot_sanity`) shows training reward, the mismatch mean |π−µ| and
the masked fraction over steps, mean over seeds with a min–max band.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from dppo.train.plot import save_figure

WINDOW = 5  # steps averaged for "final" values and the running peak
COLLAPSE_RATIO = 0.5
COLLAPSE_ZERO_ADV_STEPS = 5
TARGET_ACCURACY = 0.9
RECOVERY_TARGET = 0.95
TROUGH_STEPS = 100
OPTIONAL_MEANS = {
    "seq_removed_pos": "trust_region/seq_removed_frac_pos", "seq_removed_neg": "trust_region/seq_removed_frac_neg",
    "old_rollout_tv": "mismatch/old_rollout_tv_mean", "current_old_tv": "mismatch/current_old_tv_mean",
    "masked_from_mismatch": "trust_region/masked_frac_from_mismatch",
    "masked_from_update": "trust_region/masked_frac_from_update",
    "masked_pos": "trust_region/masked_frac_pos", "masked_neg": "trust_region/masked_frac_neg",
}
"""Summary key -> metric averaged over steps, for metrics only some methods log (None when a run has none)."""


def _series(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def running_mean(xs: Sequence[float], window: int = WINDOW) -> list[float]:
    """Means over full windows of `window` consecutive values (one mean of everything when shorter)."""
    if len(xs) <= window:
        return [sum(xs) / len(xs)] if xs else []
    return [sum(xs[i - window: i]) / window for i in range(window, len(xs) + 1)]


def steps_to_accuracy(rows: Sequence[dict], target: float = TARGET_ACCURACY) -> int | None:
    """The first step (its `step` field, else 1-based index) whose `reward/accuracy` ≥ target; None if never."""
    for i, r in enumerate(rows, 1):
        if float(r.get("reward/accuracy", 0.0)) >= target:
            return int(r.get("step", i))
    return None


def is_collapsed(rows: Sequence[dict]) -> tuple[bool, str]:
    """(collapsed, reason). Collapsed when (a) the final accuracy (mean of the last 5 steps) is below half of the
    peak 5-step running mean (full windows), and the drop is at least 0.05; or (b) 5 consecutive steps had every group with
    zero advantage (`advantage/zero_group_frac` == 1) while accuracy was below 0.5, and the final accuracy is below
    0.5 too (a stale engine can sample a gradient back into a run whose trainer had none for a while)."""
    acc = _series(rows, "reward/accuracy")
    if not acc:
        return False, "no steps"
    final = _mean(acc[-WINDOW:])
    streak = 0
    for r in rows:
        dead = float(r.get("advantage/zero_group_frac", 0.0)) >= 1.0 - 1e-9 and float(r.get("reward/accuracy", 0.0)) < 0.5
        streak = streak + 1 if dead else 0
        if streak >= COLLAPSE_ZERO_ADV_STEPS and final < 0.5:
            return True, f"every group zero-advantage for {COLLAPSE_ZERO_ADV_STEPS} steps (from step {int(r.get('step', 0)) - streak + 1})"
    peak = max(running_mean(acc))
    if final < COLLAPSE_RATIO * peak and peak - final >= 0.05:
        return True, f"final accuracy {final:.3f} < {COLLAPSE_RATIO} x peak {peak:.3f}"
    return False, ""


CRITERIA = {
    "final_accuracy": f"mean reward/accuracy of the last {WINDOW} steps",
    "steps_to_90": f"first step with reward/accuracy >= {TARGET_ACCURACY} (median over the seeds that reached it)",
    "mismatch": "mismatch/binary_tv_mean: mean |π−µ| over response tokens at the start of a step",
    "collapsed": is_collapsed.__doc__.split("Collapsed when ")[1].strip(),
}
"""The summary's definitions, recorded in sanity.json beside the numbers."""


def summarize_run(rows: Sequence[dict]) -> dict[str, Any]:
    """Final accuracy, steps to 90%, max/final mismatch, masked fraction and collapse of one run's metric rows."""
    acc = _series(rows, "reward/accuracy")
    tv = _series(rows, "mismatch/binary_tv_mean")
    collapsed, reason = is_collapsed(rows)
    return {
        "steps": len(rows),
        "initial_accuracy": _mean(acc[:WINDOW]),
        "final_accuracy": _mean(acc[-WINDOW:]),
        "peak_accuracy": max(running_mean(acc)) if acc else None,
        "steps_to_90": steps_to_accuracy(rows),
        "initial_mismatch": _mean(tv[:WINDOW]),
        "max_mismatch": max(tv) if tv else None,
        "final_mismatch": _mean(tv[-WINDOW:]),
        "masked_frac": _mean(_series(rows, "trust_region/masked_frac")),
        "masked_by_staleness": masked_by_staleness(rows),
        **trough_and_recovery(acc),
        **{key: _mean(_series(rows, metric)) for key, metric in OPTIONAL_MEANS.items()},
        "collapsed": collapsed,
        "collapse_reason": reason,
    }


def masked_by_staleness(rows: Sequence[dict]) -> dict[str, float]:
    """Staleness τ (as a string, for JSON) -> mean of `trust_region/masked_frac_stale_τ` over the steps that logged it."""
    prefix = "trust_region/masked_frac_stale_"
    keys = sorted({k for r in rows for k in r if k.startswith(prefix)}, key=lambda k: int(k[len(prefix):]))
    return {k[len(prefix):]: _mean(_series(rows, k)) for k in keys}


def trough_and_recovery(acc: Sequence[float]) -> dict[str, float | None]:
    """{"trough_accuracy", "recovery"} of an accuracy series (see the module docstring)."""
    if not acc:
        return {"trough_accuracy": None, "recovery": None}
    trough = min(running_mean(list(acc[:TROUGH_STEPS])))
    final = _mean(acc[-WINDOW:])
    recovery = (final - trough) / (RECOVERY_TARGET - trough) if trough < RECOVERY_TARGET else None
    return {"trough_accuracy": trough, "recovery": recovery}


def summarize_method(per_seed: Sequence[dict]) -> dict[str, Any]:
    """Mean over seeds of the per-run summaries; steps to 90% is the median over seeds that reached it."""
    def avg(key):
        vals = [s[key] for s in per_seed if s.get(key) is not None]
        return _mean(vals)

    reached = sorted(s["steps_to_90"] for s in per_seed if s.get("steps_to_90") is not None)
    return {
        "seeds": len(per_seed),
        "initial_accuracy": avg("initial_accuracy"),
        "final_accuracy": avg("final_accuracy"),
        "final_accuracy_min": min((s["final_accuracy"] for s in per_seed if s["final_accuracy"] is not None), default=None),
        "final_accuracy_max": max((s["final_accuracy"] for s in per_seed if s["final_accuracy"] is not None), default=None),
        "steps_to_90": reached[len(reached) // 2] if reached else None,
        "reached_90": len(reached),
        "initial_mismatch": avg("initial_mismatch"),
        "max_mismatch": max((s["max_mismatch"] for s in per_seed if s["max_mismatch"] is not None), default=None),
        "final_mismatch": avg("final_mismatch"),
        "masked_frac": avg("masked_frac"),
        "masked_by_staleness": {tau: _mean([s["masked_by_staleness"][tau] for s in per_seed
                                            if tau in (s.get("masked_by_staleness") or {})])
                                for tau in sorted({t for s in per_seed for t in (s.get("masked_by_staleness") or {})},
                                                  key=int)},
        "trough_accuracy": avg("trough_accuracy"),
        "recovery": avg("recovery"),
        **{key: avg(key) for key in OPTIONAL_MEANS},
        "collapsed": sum(bool(s["collapsed"]) for s in per_seed),
        "eval_pass@1": avg("eval_pass@1"),
        "seconds": avg("seconds"),
    }


def fmt(x, spec: str = ".3f") -> str:
    """`x` formatted by `spec`, "-" for None (a summary value a run did not produce)."""
    return "-" if x is None else format(x, spec)


def format_table(methods: dict[str, dict]) -> str:
    """One row per method (means over seeds)."""
    width = max([18] + [len(n) + 2 for n in methods])
    head = (f"{'method':<{width}}{'seeds':>6}{'acc start':>10}{'acc final':>10}{'(min-max)':>13}{'steps→90%':>10}"
            f"{'start|π−µ|':>11}{'max|π−µ|':>10}{'final|π−µ|':>11}{'masked':>8}{'collapsed':>10}{'eval':>7}{'s/run':>7}")
    lines = [head]
    for name, m in methods.items():
        s = m["summary"]
        spread = f"{fmt(s['final_accuracy_min'], '.2f')}-{fmt(s['final_accuracy_max'], '.2f')}"
        to90 = "-" if s["steps_to_90"] is None else f"{s['steps_to_90']} ({s['reached_90']}/{s['seeds']})"
        lines.append(f"{name:<{width}}{s['seeds']:>6}{fmt(s['initial_accuracy']):>10}{fmt(s['final_accuracy']):>10}"
                     f"{spread:>13}{to90:>10}{fmt(s.get('initial_mismatch'), '.4f'):>11}{fmt(s['max_mismatch'], '.4f'):>10}{fmt(s['final_mismatch'], '.4f'):>11}"
                     f"{fmt(s['masked_frac']):>8}{str(s['collapsed']) + '/' + str(s['seeds']):>10}"
                     f"{fmt(s['eval_pass@1'], '.2f'):>7}{fmt(s['seconds'], '.0f'):>7}")
    return "\n".join(lines)


def curves(runs: Sequence[Sequence[dict]], key: str) -> dict[str, list]:
    """Mean, min and max over seeds of `key` per step (steps present in every run)."""
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for i, r in enumerate(rows, 1):
            v = r.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_step.setdefault(int(r.get("step", i)), []).append(float(v))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
    return {"step": steps, "mean": [_mean(by_step[s]) for s in steps],
            "min": [min(by_step[s]) for s in steps], "max": [max(by_step[s]) for s in steps]}


CURVE_KEYS = (("reward/mean", "training reward"), ("mismatch/binary_tv_mean", "mismatch mean |π−µ| (start of step)"),
              ("trust_region/masked_frac", "masked fraction"))


def plot_sanity(methods: dict[str, dict], out: str | Path) -> Path:
    """Fig. 3 in miniature: one panel per curve in CURVE_KEYS, one line per method (mean over seeds, min–max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(6 * len(CURVE_KEYS), 4.5))
    for name, m in methods.items():
        for ax, (key, title) in zip(axes, CURVE_KEYS):
            c = m["curves"].get(key)
            if not c or not c["step"]:
                continue
            (line,) = ax.plot(c["step"], c["mean"], label=name, lw=1.5)
            ax.fill_between(c["step"], c["min"], c["max"], color=line.get_color(), alpha=0.15, lw=0)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, out)
