"""PNG plots of a mismatch report (matplotlib, Agg backend): the ratio-vs-TV band plot of the paper's Fig. 2
and histograms of the Binary / Top-K divergence estimates."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from dppo.train.plot import save_figure

_LINTHRESH = {"ratio_minus_1": 1e-2, "prob_diff": 1e-5}
"""Linear range around 0 of each symlog y axis (below it, differences are drawn linearly)."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bands(ax, report: Mapping, metric: str) -> None:
    """Median and 5–95% band per non-empty bucket, at the bucket's median µ."""
    xs, lo, mid, hi = [], [], [], []
    for row in report["buckets"]:
        stats = row.get(metric)
        if not row["count"] or not stats or None in (stats["q05"], stats["q50"], stats["q95"]):
            continue
        xs.append(row["mu"]["q50"])
        lo.append(stats["q05"]), mid.append(stats["q50"]), hi.append(stats["q95"])
    if xs:
        ax.fill_between(xs, lo, hi, color="C1", alpha=0.3, label="5–95% per µ bucket")
        ax.plot(xs, mid, "o-", color="C1", label="median per µ bucket")


def plot_ratio_vs_tv(metrics: Mapping[str, Tensor], report: Mapping, out: str | Path, *, title: str = "") -> Path:
    """Fig. 2-style plot: x = µ(a_t) (log), y = r − 1 (left) and π − µ (right), per-token scatter plus the
    per-bucket quantile bands (at each bucket's median µ). Both y axes are symlog (linear near 0), so one
    picture shows both a bf16 mismatch (~1e-3) and a moved rare token (r − 1 ~ 100)."""
    plt = _pyplot()
    mu = metrics["mu"].clamp(min=1e-12).cpu().numpy()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    panels = (("ratio_minus_1", "r − 1 = π/µ − 1"), ("prob_diff", "π − µ"))
    for ax, (metric, ylabel) in zip(axes, panels):
        ax.scatter(mu, metrics[metric].cpu().numpy(), s=3, alpha=0.25, color="C0", label="tokens")
        _bands(ax, report, metric)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=_LINTHRESH[metric])
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_xlabel("µ(a_t) (rollout probability)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    regions = report.get("trust_regions", {})
    if "ppo_clip" in regions:
        p = regions["ppo_clip"]
        for y in (p["eps_high"], -p["eps_low"]):
            axes[0].axhline(y, color="C3", ls="--", lw=1)
        axes[0].plot([], [], color="C3", ls="--", label=f"PPO clip ε {p['eps_low']}/{p['eps_high']}")
    if "dppo_binary_tv" in regions:
        p = regions["dppo_binary_tv"]
        for y in (p["delta_high"], -p["delta_low"]):
            axes[1].axhline(y, color="C2", ls="--", lw=1)
        axes[1].plot([], [], color="C2", ls="--", label=f"DPPO-Binary-TV δ {p['delta_high']}")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(title or "engine vs trainer on the same sampled tokens")
    return save_figure(fig, out, dpi=110)


def plot_histograms(metrics: Mapping[str, Tensor], out: str | Path, *, title: str = "") -> Path:
    """Histograms of log10 of the Binary / Top-K TV and KL estimates over all tokens (zeros at the floor)."""
    plt = _pyplot()
    names = [n for n in ("binary_tv", "binary_kl", "topk_tv", "topk_kl") if n in metrics]
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        x = metrics[name].double()
        x = x[torch.isfinite(x)]
        floor = 1e-12
        ax.hist(torch.log10(x.clamp(min=floor)).cpu().numpy(), bins=50, color="C0")
        ax.set_xlabel(f"log10 {name}")
        ax.set_ylabel("tokens")
        ax.set_title(f"{name}: mean {float(x.mean()):.2e}" if x.numel() else name, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title or "divergence estimates per token")
    return save_figure(fig, out, dpi=110)
