"""PNG curves of one or more runs (reward, masked fraction, mismatch, entropy, response length, held-out pass@1),
overlaid, and pass@k / maj@k per checkpoint from the rows `dppo eval --all-steps` appends to eval.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward/mean", "training reward"),
    ("trust_region/masked_frac", "masked fraction"),
    ("mismatch/binary_tv_mean", "mismatch mean |π−µ| (start of step)"),
    ("policy/entropy", "entropy"),
    ("response/length_mean", "response length"),
    ("eval/pass@1", "held-out pass@1"),
    ("eval/pass@k", "pass@k (solid), maj@k (dashed) per checkpoint"),
)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"run_dir: {run_dir} has no metrics.jsonl")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: malformed JSON line ({exc})") from None
    return rows


def read_eval(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_curves(evals: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """"pass@k" / "maj@k" -> [(step, value)] by step, from the rows of `dppo eval` ("by": "dppo eval"); a step
    evaluated twice keeps its last row."""
    by_step = {e["step"]: e for e in evals if e.get("by") == "dppo eval"}
    curves: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key.startswith(("pass@", "maj@")) and isinstance(value, (int, float)):
                curves.setdefault(key, []).append((step, value))
    return dict(sorted(curves.items(), key=lambda kv: (kv[0][:4], int(kv[0].split("@")[1]))))


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, labels: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    labels = labels or [Path(d).name for d in run_dirs]
    for run_dir, label in zip(run_dirs, labels):
        rows = read_metrics(run_dir)
        evals = read_eval(run_dir)
        for ax, (key, title) in zip(axes.flat, PANELS):
            if key == "eval/pass@k":
                for name, curve in checkpoint_curves(evals).items():
                    ax.plot(*zip(*curve), "--" if name.startswith("maj") else "-", marker="o", ms=3,
                            label=f"{label} {name}")
                ax.set_title(title)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                if ax.get_lines():
                    ax.legend(fontsize=7)
                continue
            if key == "eval/pass@1":
                pts = [(e["step"], e["pass@1"]) for e in evals if "by" not in e]
            else:
                pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=label)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    pass_k = axes.flat[[key for key, _ in PANELS].index("eval/pass@k")]
    if not pass_k.get_lines():  # the training run's own evaluations are in the pass@1 panel
        pass_k.text(0.5, 0.5, "no checkpoint evaluations yet:\ndppo eval --run-dir DIR --all-steps --k 1,4,8",
                    ha="center", va="center", transform=pass_k.transAxes, fontsize=9, color="0.4")
    axes.flat[len(PANELS)].axis("off")
    # fixed margins for this fixed grid: tight_layout draws the whole figure once more to measure it (half the
    # plot's ~0.6 s, paid at the end of every `dppo train`)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.06, top=0.95, wspace=0.22, hspace=0.3)
    return save_figure(fig, out, tight=False)


def save_figure(fig, out: str | Path, *, dpi: int = 100, tight: bool = True) -> Path:
    """Lay out (`tight`: matplotlib's tight_layout), write (creating the folder) and close a matplotlib figure;
    returns the path."""
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
