"""The trust regions for stale data, the sequence mask and the mismatch split inside the trainer (tiny model, a few
steps): the version lag reaches the mask, the split's metrics are those of `dppo.metrics.mismatch_split`, bad
settings fail in the config naming the field."""

from __future__ import annotations

import pytest
import torch

from conftest import smoke_config
from dppo.train.config import ConfigError, LossConfig
from dppo.train.trainer import Trainer

STEPS = 3


def _run(tmp_path, name, **sections):
    run_dir = tmp_path / name
    trainer = Trainer(smoke_config(run_dir, train={"steps": STEPS, "eval_every": 0}, **sections), run_dir)
    try:
        rows = [trainer.step() for _ in range(STEPS)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return rows, weights


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_stale_tv_is_dppo_at_alpha_zero_and_tighter_with_a_large_alpha(tmp_path):
    lag = {"engine_lag": 2}
    plain, w_plain = _run(tmp_path, "plain", rollout=lag, loss={"trust_region": "dppo_binary_tv"})
    zero, w_zero = _run(tmp_path, "zero", rollout=lag, loss={"trust_region": "dppo_stale_tv", "stale_alpha": 0.0})
    big, w_big = _run(tmp_path, "big", rollout=lag, loss={"trust_region": "dppo_stale_tv", "stale_alpha": 1e6})
    assert _same(w_plain, w_zero)  # α = 0: exactly DPPO-Binary-TV
    assert [r["rollout/staleness_max"] for r in big] == [0.0, 1.0, 2.0]
    # fresh step 1: δ(0) = δ, the same update as DPPO; stale steps: δ(τ) ≈ 0 masks every token moving away
    assert big[0]["trust_region/masked_frac"] == plain[0]["trust_region/masked_frac"]
    assert big[2]["trust_region/masked_frac"] > plain[2]["trust_region/masked_frac"]
    assert not _same(w_plain, w_big)


def test_a_sequence_mask_that_removes_everything_leaves_the_weights_unchanged(tmp_path):
    rows, w = _run(tmp_path, "all", loss={"sequence_mask": "max_divergence", "sequence_delta": -1.0})
    init = Trainer(smoke_config(tmp_path / "init"), tmp_path / "init")
    before = {n: p.detach().clone() for n, p in init.model.named_parameters()}
    init.close()
    assert _same(w, before)  # weight decay 0, every gradient exactly 0
    for r in rows:
        assert r["trust_region/masked_frac"] == 1.0
        assert r["trust_region/seq_removed_frac_pos"] == 1.0 and r["trust_region/seq_removed_frac_neg"] == 1.0
        assert r["trust_region/seq_removed_token_frac_neg"] == 1.0
    kept, _ = _run(tmp_path, "none", loss={"sequence_mask": "max_divergence", "sequence_delta": 10.0})
    assert all(r["trust_region/seq_removed_frac_pos"] == 0.0 for r in kept)


def test_mismatch_split_metrics(tmp_path):
    rows, _ = _run(tmp_path, "split", rollout={"engine_lag": 2}, loss={"split_mismatch": True})
    keys = ("mismatch/old_rollout_tv_mean", "mismatch/current_old_tv_mean", "trust_region/masked_frac_from_mismatch",
            "trust_region/masked_frac_from_update")
    for r in rows:
        assert all(k in r for k in keys)
        assert r["trust_region/masked_frac_from_mismatch"] + r["trust_region/masked_frac_from_update"] == \
            pytest.approx(r["trust_region/masked_frac"], abs=1e-6)
    # step 1 is fresh (the float32 engine holds the trainer's weights): π_old = µ up to kernels; later steps are 1 and
    # 2 versions stale, so π_old/µ carries the drift; π/π_old is what the step's own 4 mini-batches moved
    assert rows[0]["mismatch/old_rollout_tv_mean"] < 1e-5
    assert rows[2]["mismatch/old_rollout_tv_mean"] > 10 * rows[0]["mismatch/old_rollout_tv_mean"]
    assert all(r["mismatch/current_old_tv_mean"] > 0 for r in rows)
    plain, _ = _run(tmp_path, "plain", rollout={"engine_lag": 2})
    assert not any(k in plain[0] for k in keys)


@pytest.mark.parametrize("fields, match", [
    ({"sequence_mask": "max"}, r"^loss.sequence_mask: "),
    ({"sequence_mask": "mean_k3", "sequence_delta": float("nan")}, r"^loss.sequence_delta: expected a finite number"),
    ({"sequence_unit": "episode"}, r"^loss.sequence_unit: "),
    ({"sequence_sides": "positive"}, r"^loss.sequence_sides: "),
    ({"loss": "drpo", "sequence_mask": "mean_k3"}, r"^loss.sequence_mask: drpo has no mask"),
    ({"trust_region": "dppo_stale_tv", "stale_alpha": -1.0}, r"^loss.stale_alpha: expected >= 0"),
    ({"trust_region": "dppo_sat_tv", "sat_quantile": 1.0}, r"^loss.sat_quantile: expected in \(0, 1\)"),
    ({"trust_region": "dppo_sat_kl", "sat_shrink": 1.5}, r"^loss.sat_shrink: expected in \[0, 1\]"),
])
def test_config_refuses_bad_settings_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**fields)
