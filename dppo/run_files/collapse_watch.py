"""The collapse warning of a running run (`log.collapse_warning`): `dppo.collapse_warning.RULE` applied to each step's
metrics as the logger writes them.

Every step's record gets `warning/collapse_score` (the rule's monitor, once it has a score) and `warning/collapse`
(1.0 while the score is at or above the threshold, else 0.0); the first step it fires, the run prints one line that
names the monitor, its value and what to run next (`dppo doctor`). How well the rule foresees a collapse, and how
often it fires on runs that do not collapse, is measured in docs/paper.md ("Can the ledger foresee a collapse?"):
read the line as a prompt to look, not as a verdict.

The monitor needs the run's first `BASELINE` steps and its last `3 × WINDOW`; only those rows are kept (a resumed run
reads them back from its metrics.jsonl).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from dppo import collapse_warning as cw

EXPLAIN = {
    "tv_rise": "the mean |π − µ| during the update is {score:.3g}x its first steps' (threshold {threshold:g}x)",
    "bound_rise": "Thm. 3.2's divergence penalty is {score:.3g}x its first steps' (threshold {threshold:g}x)",
    "tv_max_rise": "the largest token |π − µ| is {score:.3g}x its first steps' (threshold {threshold:g}x)",
    "drift_rise": "the drift |log π − log µ| is {score:.3g}x its first steps' (threshold {threshold:g}x)",
    "mask_on_mismatch": "{score:.1%} of the gradient mass is masked for the mismatch (threshold {threshold:.1%})",
    "stale_share": "staleness is {score:.1%} of the drift (threshold {threshold:.1%})",
}


class CollapseWatch:
    """`RULE` = (monitor, threshold) on the metric rows seen so far (`rows`: a resumed run's earlier ones)."""

    def __init__(self, rule: tuple[str, float] = cw.RULE, rows: Sequence[Mapping[str, Any]] = ()) -> None:
        self.monitor, self.threshold = rule
        cw.scores([], self.monitor)  # checks the name
        self.rows: list[dict[str, float]] = []
        self.seen = 0
        self.fired_at: int | None = None
        self.said_missing = False
        for r in rows:
            self._add(r)

    def _add(self, metrics: Mapping[str, Any]) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.seen += 1
        keep = 3 * cw.WINDOW
        if len(self.rows) > cw.BASELINE + keep:  # the baseline's rows and the latest windows' are all a score reads
            del self.rows[cw.BASELINE]

    def update(self, step: int, metrics: Mapping[str, Any]) -> tuple[dict[str, float], str | None]:
        """The step's `warning/*` metrics and the line to print (None: nothing to say)."""
        self._add(metrics)
        score = cw.scores(self.rows, self.monitor)[-1]
        out: dict[str, float] = {}
        line = None
        if score is None or not math.isfinite(score):
            if self.seen == cw.BASELINE + 1 and not self.said_missing:
                self.said_missing = True
                line = (f"[dppo] collapse warning off: its monitor {self.monitor!r} has no value in this run's metrics "
                        f"(see docs/paper.md, 'Can the ledger foresee a collapse?')")
            return out, line
        fired = score >= self.threshold
        out = {"warning/collapse_score": score, "warning/collapse": float(fired)}
        if fired and self.fired_at is None:
            self.fired_at = step
            why = EXPLAIN.get(self.monitor, f"{self.monitor} {{score:.3g}} >= {{threshold:g}}")
            line = (f"[dppo] step {step}: collapse warning: {why.format(score=score, threshold=self.threshold)}; "
                    f"`dppo doctor` on the run directory says where the drift comes from")
        return out, line
