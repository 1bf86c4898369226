"""Collapse warning (issue 52): monitors that turn a run's per-step metrics into a score, and the rule `dppo train`
applies to the ledger.

A monitor reads one or two logged series (`metrics.jsonl` keys) and gives a score per step that uses the steps up to
that one only (causal: what a running run knows). Every monitor compares the mean of the last `WINDOW` steps with
its baseline, the mean of the first `BASELINE` steps of the run, and has its first score at step `BASELINE + 1`
(the first steps of a warm-started run make its baseline; until `BASELINE + WINDOW` its window overlaps them). A
monitor *fires* at the first step whose score is at least its threshold.

Monitors on the trust-region ledger (`dppo.ledger`; docs/cli.md "The trust-region ledger"):
- `tv_rise`: the mean |π − µ| during the update (`mismatch/binary_tv_mean`) over its baseline (a ratio);
- `bound_rise`: Thm. 3.2's first penalty 4ξ E[Σ_t D_t] (`ledger/bound_sum`) over its baseline;
- `tv_max_rise`: the largest token TV of the step (`ledger/tv_max`) over its baseline;
- `drift_rise`: mean |log π − log µ| (`ledger/drift_net`, logged with the drift split) over its baseline;
- `mask_on_mismatch`: the share of the gradient mass masked because of the mismatch (`ledger/masked_mass_mismatch_*`);
- `stale_share`: the staleness part's share of the drift (`ledger/drift_staleness_share`).

The simple monitors others propose, for comparison (the same windows):
- `kl_acceleration`: the second difference of the mismatch KL (`mismatch/binary_kl_mean`) over steps `WINDOW`
  apart, (m_t − 2 m_{t−W} + m_{t−2W}) / baseline, m the `WINDOW`-step mean;
- `entropy_drop`: 1 − m_t / baseline of the policy entropy (`policy/entropy`);
- `advantage_drift`: |m_t − baseline| / baseline of the advantage std (`ledger/adv_std`; a group-mean advantage's own
  mean is 0 by construction, so its spread is what drifts).

`RULE` is the monitor and threshold `dppo train` warns with; its numbers were fixed on part of a corpus of runs and
measured on the others (`dppo.studies.warning`, docs/paper.md "Can the ledger foresee a collapse?"). Pure Python:
lists of numbers in, lists out.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

BASELINE = 5
"""The first steps of a run, whose mean is each monitor's baseline."""
WINDOW = 5
"""Steps averaged for a monitor's current value."""
EPS = 1e-12

Series = Sequence[float | None]
Score = list[float | None]


def series(rows: Sequence[Mapping], *keys: str) -> list[float | None]:
    """The sum of `keys` per row (None where a row lacks one of them or a value is not finite)."""
    out: list[float | None] = []
    for r in rows:
        vals = [r.get(k) for k in keys]
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals)
        out.append(float(sum(vals)) if ok else None)  # type: ignore[arg-type]
    return out


def window_mean(xs: Series, end: int, width: int = WINDOW) -> float | None:
    """Mean of the values of xs[end − width + 1 .. end] that are there (None when none is)."""
    vals = [x for x in xs[max(0, end - width + 1): end + 1] if x is not None]
    return sum(vals) / len(vals) if vals else None


def _relative(xs: Series, f: Callable[[float, float], float], start: int = BASELINE) -> Score:
    """f(m_t, baseline) per step from step index `start` on (None before, or where a mean is missing)."""
    base = window_mean(xs, BASELINE - 1, BASELINE)
    out: Score = []
    for t in range(len(xs)):
        m = window_mean(xs, t) if t >= start else None
        out.append(None if m is None or base is None else f(m, base))
    return out


def rise(xs: Series) -> Score:
    """m_t / baseline."""
    return _relative(xs, lambda m, b: m / max(b, EPS))


def level(xs: Series) -> Score:
    """m_t itself (a share: already on a common scale)."""
    return _relative(xs, lambda m, b: m)


def drop(xs: Series) -> Score:
    """1 − m_t / baseline."""
    return _relative(xs, lambda m, b: 1.0 - m / max(b, EPS))


def drift(xs: Series) -> Score:
    """|m_t − baseline| / baseline."""
    return _relative(xs, lambda m, b: abs(m - b) / max(abs(b), EPS))


def acceleration(xs: Series) -> Score:
    """(m_t − 2 m_{t−W} + m_{t−2W}) / baseline, m the W-step mean."""
    base = window_mean(xs, BASELINE - 1, BASELINE)
    out: Score = []
    for t in range(len(xs)):
        ms = [window_mean(xs, t - k * WINDOW) for k in range(3)] if t >= BASELINE + 2 * WINDOW else [None]
        out.append(None if base is None or any(m is None for m in ms)
                   else (ms[0] - 2 * ms[1] + ms[2]) / max(abs(base), EPS))  # type: ignore[operator]
    return out


MASK_MISMATCH = ("ledger/masked_mass_mismatch_pos", "ledger/masked_mass_mismatch_neg")

MONITORS: dict[str, tuple[str, Callable[[Sequence[Mapping]], Score]]] = {
    # name: (kind, rows -> score per step). kind: "ledger" (dppo's) or "simple" (the monitors others propose).
    "tv_rise": ("ledger", lambda rows: rise(series(rows, "mismatch/binary_tv_mean"))),
    "bound_rise": ("ledger", lambda rows: rise(series(rows, "ledger/bound_sum"))),
    "tv_max_rise": ("ledger", lambda rows: rise(series(rows, "ledger/tv_max"))),
    "drift_rise": ("ledger", lambda rows: rise(series(rows, "ledger/drift_net"))),
    "mask_on_mismatch": ("ledger", lambda rows: level(series(rows, *MASK_MISMATCH))),
    "stale_share": ("ledger", lambda rows: level(series(rows, "ledger/drift_staleness_share"))),
    "kl_acceleration": ("simple", lambda rows: acceleration(series(rows, "mismatch/binary_kl_mean"))),
    "entropy_drop": ("simple", lambda rows: drop(series(rows, "policy/entropy"))),
    "advantage_drift": ("simple", lambda rows: drift(series(rows, "ledger/adv_std"))),
}
"""The monitors by name: adding one is a function of the rows and an entry here."""

RULE: tuple[str, float] = ("tv_max_rise", 1.5821163657288824)
"""(monitor, threshold) of the warning `dppo train` prints and logs (`warning/collapse`): the ledger monitor and the
threshold the study chose on its fit seeds (docs/data/warning/warning.json, `rule` and `fit`); a test keeps them
equal."""


def scores(rows: Sequence[Mapping], monitor: str) -> Score:
    """The score per step of `monitor` (a MONITORS name) on a run's metric rows."""
    if monitor not in MONITORS:
        raise ValueError(f"monitor: unknown {monitor!r}; valid: {', '.join(MONITORS)}")
    return MONITORS[monitor][1](rows)


def first_fire(score: Series, threshold: float) -> int | None:
    """The index of the first step whose score is ≥ threshold (None if never)."""
    return next((t for t, s in enumerate(score) if s is not None and s >= threshold), None)
