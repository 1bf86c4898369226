"""`dppo doctor RUN_DIR`: why is this run unstable? Reads a run directory (a finished or a running one) and answers in
plain words, with the evidence, from the trust-region ledger its steps logged (`dppo.ledger`):

- which source dominates the policy's drift away from µ — the engine's numerics (*precision*), the version lag
  (*staleness*) or the step's own updates (*learning*) — and since which step;
- whether the trust region's mask fires on the mismatch (tokens µ and π_old already disagree on) rather than on
  learning (the update's own push, which is its job);
- what the user can change: the engine's or the trainer's precision, the staleness, δ, the learning rate, the
  anchor;
- when the collapse warning fired (`warning/collapse`);
- and a picture of the ledger over the steps (`doctor.png` in the run directory).

The reading is a pure function of the logged rows and the run's config (`diagnose`), so it is tested on
constructed runs where the answer is known; `main` reads the files and prints it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCES = ("precision", "staleness", "learning")
"""The drift's sources, in the ledger's order (`dppo.ledger.DRIFT_KEYS`)."""
WINDOW = 10
"""Steps the verdict reads (the run's last ones)."""
MASK_ALARM = 0.05
"""A masked share of the gradient mass above this is worth a sentence."""


@dataclass
class Report:
    """What `diagnose` found: the verdict's lines, the evidence behind them and the advice."""

    steps: int
    dominant: str | None = None
    """The source with the largest share of the drift over the last WINDOW steps (None: no ledger logged)."""
    since: int | None = None
    """The first step from which `dominant` has led every logged step."""
    shares: dict[str, float] = field(default_factory=dict)
    masked_mass: float | None = None
    mask_on_mismatch: float | None = None
    """The share of the masked gradient mass whose mask fired on the mismatch (None: not split)."""
    warned_at: int | None = None
    """The first step the collapse warning fired (`warning/collapse`, `log.collapse_warning`; None: it did not)."""
    findings: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"dppo doctor: {self.steps} step(s) read"]
        lines += [f"- {f}" for f in self.findings]
        if self.evidence:
            lines += ["evidence:"] + [f"  {e}" for e in self.evidence]
        if self.advice:
            lines += ["what to change:"] + [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The training steps of `run_dir`/metrics.jsonl in order (a running run's torn last line is skipped; a later
    row of the same step, after a resume, replaces the earlier one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run directory, or no step logged yet)")
    rows: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines):
                continue  # (the run is writing it)
            raise ValueError(f"{path}: line {i}: not valid JSON") from None
        if isinstance(row, dict) and "step" in row and "loss/policy" in row:
            rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def _leader(row: dict) -> str | None:
    parts = {s: row.get(f"ledger/drift_{s}") for s in SOURCES}
    if any(not isinstance(v, (int, float)) for v in parts.values()) or sum(parts.values()) <= 0:
        return None
    return max(parts, key=parts.get)


def diagnose(rows: list[dict[str, Any]], config: dict[str, Any] | None = None) -> Report:
    """The doctor's reading of a run's logged steps (`read_rows`) and its config.yaml as a dict (see the module)."""
    config = config or {}
    rollout, model, optim = config.get("rollout", {}), config.get("model", {}), config.get("optim", {})
    report = Report(steps=len(rows))
    if not rows:
        report.findings.append("no training step logged yet")
        return report
    recent = rows[-WINDOW:]
    first, last = int(recent[0]["step"]), int(recent[-1]["step"])
    means = {s: _mean(recent, f"ledger/drift_{s}") for s in SOURCES}
    if any(v is None for v in means.values()):
        report.findings.append("the run logged no drift split (it needs π_old: run with --loss.split-mismatch, "
                               "or --loss.anchor recompute, which make one no-grad forward per step)")
    else:
        total = sum(means.values())
        report.shares = {s: (v / total if total > 0 else 0.0) for s, v in means.items()}
        report.dominant = max(report.shares, key=report.shares.get)
        leaders = [_leader(r) for r in rows]
        since = int(rows[-1]["step"])
        for row, leader in zip(reversed(rows), reversed(leaders)):
            if leader != report.dominant:
                break
            since = int(row["step"])
        report.since = since
        words = {"precision": "the engine's numerics (µ against π at the same weights)",
                 "staleness": "the version lag (responses sampled by older weights)",
                 "learning": "the step's own updates (π moving from π_old within the step)"}
        report.findings.append(f"the drift away from µ is dominated by {report.dominant}: {words[report.dominant]}, "
                               f"{report.shares[report.dominant]:.0%} of it over steps {first}-{last}"
                               + (f", leading every step since step {since}" if since <= last else ""))
        report.evidence.append("mean |log-ratio part| per token, steps %d-%d: " % (first, last) + ", ".join(
            f"{s} {means[s]:.2e} ({report.shares[s]:.0%})" for s in SOURCES))
    _mask(report, recent)
    fired = [r for r in rows if r.get("warning/collapse") == 1.0]
    if fired:
        report.warned_at = int(fired[0]["step"])
        report.findings.append(f"the collapse warning fired at step {report.warned_at} (score "
                               f"{fired[0].get('warning/collapse_score', float('nan')):.3g}); docs/paper.md, 'Can the "
                               f"ledger foresee a collapse?', says how often it is right")
    _advice(report, rollout, model, optim, recent)
    return report


def _mask(report: Report, recent: list[dict]) -> None:
    mass = _mean(recent, "ledger/masked_mass")
    frac = _mean(recent, "trust_region/masked_frac")
    if mass is None:
        return
    report.masked_mass = mass
    parts = {k: _mean(recent, f"ledger/masked_mass_{k}") or 0.0
             for k in ("mismatch_pos", "mismatch_neg", "update_pos", "update_neg")}
    on_mismatch = parts["mismatch_pos"] + parts["mismatch_neg"]
    split = report.dominant is not None  # (the source of a masked token needs π_old, as the drift split does)
    report.mask_on_mismatch = on_mismatch / mass if split and mass > 0 else None
    report.evidence.append(f"masked: {mass:.1%} of the gradient mass |Â|·π/µ"
                           + (f", {frac:.1%} of the tokens" if frac is not None else "")
                           + (", by source and sign: " + ", ".join(f"{k} {v:.1%}" for k, v in parts.items())
                              if split else ""))
    if mass < MASK_ALARM:
        report.findings.append(f"the trust region masks little ({mass:.1%} of the gradient mass)")
    elif report.mask_on_mismatch is not None and report.mask_on_mismatch >= 0.5:
        report.findings.append(f"the mask fires mostly on the mismatch ({report.mask_on_mismatch:.0%} of the masked "
                               f"mass): tokens the engine and the trainer disagree on before any update, not "
                               f"the update's own push — the trust region spends itself on the engine")
    elif report.mask_on_mismatch is not None:
        report.findings.append(f"the mask fires mostly on learning ({1 - report.mask_on_mismatch:.0%} of the masked "
                               f"mass: the update's own push), which is its job")


def _advice(report: Report, rollout: dict, model: dict, optim: dict, recent: list[dict]) -> None:
    engines = [e for e in rollout.get("engines") or [] if isinstance(e, dict)]  # (older run dirs: the flat fields)
    first = engines[0] if engines else rollout
    dtype, precision = first.get("dtype"), model.get("precision")
    lag = max((e.get("lag", 0) or 0 for e in engines), default=rollout.get("engine_lag", 0) or 0)
    staleness = rollout.get("max_staleness", 0) or 0
    lr = optim.get("lr")
    if report.dominant == "precision":
        if dtype in ("bfloat16", "float16") and precision == "fp32":
            report.advice.append(f"the engine samples in {dtype} beside an fp32 trainer: sample in float32 "
                                 f"(--rollout.dtype float32), or train with bf16 autocast (--model.precision bf16) "
                                 f"so both round alike")
        elif first.get("quantization") == "fp8" or first.get("fp8"):
            report.advice.append("the engine samples from fp8 weights: drop rollout.quantization, or widen δ")
        else:
            report.advice.append(f"the engine ({first.get('kind', first.get('engine', '?'))}, {dtype}) and the trainer ({precision}) "
                                 f"compute differently: align their dtypes and kernels (docs/engines.md)")
        report.advice.append("a wider δ (loss.delta_high/delta_low) lets through what the engine's numerics move; "
                             "the recompute anchor does not help (the paper's §5.2)")
    elif report.dominant == "staleness":
        knob = ("rollout.engine-lag" if lag else "rollout.max-staleness") if rollout else \
            "rollout.engine-lag or rollout.max-staleness"
        logged = [int(r["rollout/staleness_max"]) for r in recent if isinstance(r.get("rollout/staleness_max"), (int, float))]
        most = max(logged) if logged else max(lag, staleness)  # what the steps saw, else what the config allows
        report.advice.append(f"the responses are up to {most} step(s) stale ({knob}): lower it, or "
                             f"let newer weights reach responses in flight (rollout.in_flight_updates, async)")
    entropy = [_mean([r], "policy/entropy") for r in recent]
    entropy = [e for e in entropy if e is not None]
    collapsing = len(entropy) >= 2 and entropy[0] > 0 and entropy[-1] < 0.5 * entropy[0]
    if collapsing:
        report.findings.append(f"the policy's entropy halved over steps {recent[0]['step']}-{recent[-1]['step']} "
                               f"({entropy[0]:.3f} -> {entropy[-1]:.3f})")
    if report.dominant == "learning":
        mass = report.masked_mass or 0.0
        if mass >= MASK_ALARM or collapsing:
            why = (f"the updates push hard against the trust region ({mass:.1%} of the gradient mass masked)"
                   if mass >= MASK_ALARM else "the updates sharpen the policy fast (its entropy halved)")
            smaller = f" (optim.lr {lr:g} -> {lr / 2:g})" if lr is not None else ""
            report.advice.append(f"{why}: a smaller learning rate{smaller}, or fewer mini-batches or epochs per "
                                 f"rollout batch; a tighter δ holds each update closer to µ")
        else:
            report.advice.append("learning leads the drift and the mask holds it: the run looks healthy on this "
                                 "count")


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """The ledger over the steps: the drift's parts, the masked mass by source, reward and entropy (one figure)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for s in SOURCES:
        axes[0].plot(steps, [r.get(f"ledger/drift_{s}", float("nan")) for r in rows], label=s)
    axes[0].set_ylabel("mean |log-ratio part|")
    axes[0].set_yscale("log")
    for k in ("mismatch_pos", "mismatch_neg", "update_pos", "update_neg"):
        axes[1].plot(steps, [r.get(f"ledger/masked_mass_{k}", float("nan")) for r in rows], label=k)
    axes[1].set_ylabel("masked gradient mass")
    axes[2].plot(steps, [r.get("reward/mean", float("nan")) for r in rows], label="reward/mean")
    axes[2].plot(steps, [r.get("policy/entropy", float("nan")) for r in rows], label="policy/entropy")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(run_dir: str, *, picture: bool = True) -> Report:
    """Read `run_dir`, print the doctor's reading, and write the picture beside the run's files."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    report = diagnose(rows, config)
    if not config:
        report.findings.append("no config.yaml in the run directory: the advice cannot name the run's settings")
    text = report.text()
    if picture:
        path = plot(rows, run_dir / "doctor.png")
        if path is not None:
            text += f"\npicture: {path}"
    print(text)
    return report
