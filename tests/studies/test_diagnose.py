"""The mismatch report (`dppo.studies.diagnose`): hand-built tensors, then `run_diagnose` end to end on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dppo.studies.diagnose import DEFAULT_BUCKETS, METRICS, mismatch_report, token_metrics
from dppo.divergence import binary_kl, topk_tv


def _row(report, i):
    return report["buckets"][i]


def test_bucket_assignment_and_empty_buckets():
    mu = torch.tensor([[5e-7, 3e-6, 3e-6, 5e-3, 0.5, 1.0]])
    report = mismatch_report(mu.log(), mu.log(), torch.ones_like(mu, dtype=torch.bool))
    counts = [b["count"] for b in report["buckets"]]
    assert counts == [1, 2, 0, 0, 1, 0, 2]  # [0,1e-6) [1e-6,1e-5) [1e-5,1e-4) [1e-4,1e-3) [1e-3,1e-2) [1e-2,1e-1) [1e-1,1]
    assert report["num_tokens"] == 6 and report["overall"]["count"] == 6
    empty = _row(report, 2)
    assert all(empty[m] is None for m in METRICS if m in empty)
    assert empty["masked_frac"] == {"ppo_clip": {"pos": None, "neg": None}, "dppo_binary_tv": {"pos": None, "neg": None}}
    assert [b["lo"] for b in report["buckets"]] + [report["buckets"][-1]["hi"]] == list(DEFAULT_BUCKETS)
    assert report["buckets"][-1]["label"].endswith("]") and report["buckets"][0]["label"].endswith(")")
    json.dumps(report, allow_nan=False)  # JSON-ready, strict


def test_custom_buckets_and_invalid_buckets():
    mu = torch.tensor([[0.05, 0.2, 0.7]])
    report = mismatch_report(mu.log(), mu.log(), torch.ones_like(mu, dtype=torch.bool), buckets=(0.1, 0.5, 1.0))
    assert [b["count"] for b in report["buckets"]] == [1, 1]  # 0.05 is below the first edge: overall only
    assert report["overall"]["count"] == 3
    for bad in ((0.5,), (0.0, 0.5), (0.0, 0.5, 0.5, 1.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="buckets"):
            mismatch_report(mu.log(), mu.log(), torch.ones_like(mu, dtype=torch.bool), buckets=bad)


def test_spec_examples_ppo_vs_dppo_masks():
    """µ=1e-4 → π=1e-2: PPO masks it for Â>0 (r = 100), DPPO does not (|π−µ| ≈ 0.01).
    µ=0.99 → π=0.80: DPPO masks it for Â<0 (0.19 > δ), PPO does not (r ≈ 0.81 > 1 − 0.2)."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    low = mismatch_report(torch.tensor([[1e-2]]).log(), torch.tensor([[1e-4]]).log(), mask)["overall"]["masked_frac"]
    assert low["ppo_clip"] == {"pos": 1.0, "neg": 0.0}
    assert low["dppo_binary_tv"] == {"pos": 0.0, "neg": 0.0}
    high = mismatch_report(torch.tensor([[0.80]]).log(), torch.tensor([[0.99]]).log(), mask)["overall"]["masked_frac"]
    assert high["ppo_clip"] == {"pos": 0.0, "neg": 0.0}
    assert high["dppo_binary_tv"] == {"pos": 0.0, "neg": 1.0}


def test_stats_match_direct_computation_and_padding_is_ignored():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 40
    rollout_logp = -torch.rand(B, T, generator=g) * 12  # µ from ~6e-6 to 1
    logp = rollout_logp + 0.3 * torch.randn(B, T, generator=g)
    logp = logp.clamp(max=-1e-3)  # π(a_t) = 1 exactly would hit binary_kl's documented float32 clamp
    mask = torch.rand(B, T, generator=g) > 0.3
    # padding holds garbage that must not count
    report = mismatch_report(torch.where(mask, logp, torch.full_like(logp, 5.0)),
                             torch.where(mask, rollout_logp, torch.full_like(logp, float("nan"))), mask)
    lp, mlp = logp[mask].double(), rollout_logp[mask].double()
    mu = mlp.exp()
    assert report["num_tokens"] == int(mask.sum())
    checked = 0
    for row in report["buckets"]:
        sel = (mu.float() >= row["lo"]) & ((mu.float() < row["hi"]) | (row["hi"] == 1.0))
        assert row["count"] == int(sel.sum())
        if not row["count"]:
            continue
        r1 = (lp[sel] - mlp[sel]).exp() - 1
        diff = (lp[sel].exp() - mu[sel]).abs()
        for name, ref in (("ratio_minus_1", r1), ("binary_tv", diff), ("binary_kl", binary_kl(lp[sel], mlp[sel]))):
            s = row[name]
            torch.testing.assert_close(torch.tensor([s["mean"], s["std"], s["min"], s["max"]], dtype=torch.float64),
                                       torch.stack([ref.mean(), ref.std(correction=0), ref.min(), ref.max()]),
                                       rtol=1e-5, atol=1e-7)  # float32 inputs vs a float64 reference
            q = torch.quantile(ref, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
            torch.testing.assert_close(torch.tensor([s["q05"], s["q50"], s["q95"]], dtype=torch.float64), q,
                                       rtol=1e-5, atol=1e-7)
        ppo_pos = ((lp[sel] - mlp[sel]).exp() > 1.28).double().mean()
        dppo_neg = ((mu[sel] - lp[sel].exp()) > 0.15).double().mean()
        assert row["masked_frac"]["ppo_clip"]["pos"] == pytest.approx(float(ppo_pos))
        assert row["masked_frac"]["dppo_binary_tv"]["neg"] == pytest.approx(float(dppo_neg))
        checked += 1
    assert checked >= 4
    assert "topk_tv" not in report["overall"]


def test_topk_metrics_and_coverage():
    # one token, K = 3 (+ the sampled-token slot): µ's top-3 hold 0.5 + 0.2 + 0.1; the sampled token (0.05)
    # is outside them, so the extra slot is valid but does not count toward the top-K coverage.
    rollout_topk = torch.tensor([[[0.5, 0.2, 0.1, 0.05]]]).log()
    topk = torch.tensor([[[0.4, 0.3, 0.1, 0.06]]]).log()
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    mask = torch.ones(1, 1, dtype=torch.bool)
    kw = dict(topk_logp=topk, rollout_topk_logp=rollout_topk, topk_valid=valid)
    report = mismatch_report(topk[..., 3], rollout_topk[..., 3], mask, **kw)
    assert report["overall"]["topk_coverage"]["mean"] == pytest.approx(0.8)
    assert report["overall"]["topk_tv"]["mean"] == pytest.approx(float(topk_tv(topk, rollout_topk, valid)))
    assert report["overall"]["topk_tv"]["mean"] == pytest.approx(0.5 * (0.1 + 0.1 + 0 + 0.01 + 0.01))
    # sampled token inside the top-K: the extra slot is invalid; an invalid top slot drops out of the coverage
    valid2 = torch.tensor([[[True, False, True, False]]])
    report2 = mismatch_report(topk[..., 0], rollout_topk[..., 0], mask, **{**kw, "topk_valid": valid2})
    assert report2["overall"]["topk_coverage"]["mean"] == pytest.approx(0.6)
    metrics = token_metrics(topk[..., 3], rollout_topk[..., 3], mask, **kw)
    assert set(METRICS) <= set(metrics) and metrics["mu"].shape == (1,)
    with pytest.raises(ValueError, match="topk_logp"):
        mismatch_report(topk[..., 0], rollout_topk[..., 0], mask, topk_logp=topk)


def test_trust_region_overrides_and_unknown_name():
    mu, pi = torch.tensor([[0.5]]), torch.tensor([[0.6]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    tight = mismatch_report(pi.log(), mu.log(), mask, trust_regions={"dppo_binary_tv": {"delta_high": 0.05}})
    assert tight["overall"]["masked_frac"] == {"dppo_binary_tv": {"pos": 1.0, "neg": 0.0}}
    assert tight["trust_regions"]["dppo_binary_tv"]["delta_high"] == 0.05
    with pytest.raises(ValueError, match="unknown"):
        mismatch_report(pi.log(), mu.log(), mask, trust_regions={"nope": {}})
    with pytest.raises(ValueError, match="Top-K"):
        mismatch_report(pi.log(), mu.log(), mask, trust_regions={"dppo_topk_tv": {}})
    with pytest.raises(ValueError, match="'dppo_stale_tv' reads staleness"):
        mismatch_report(pi.log(), mu.log(), mask, trust_regions={"dppo_stale_tv": {}})
    sat = mismatch_report(pi.log(), mu.log(), mask, trust_regions={"dppo_sat_tv": {"sat_shrink": 0.5}})
    assert sat["overall"]["masked_frac"] == {"dppo_sat_tv": {"pos": 0.0, "neg": 0.0}}  # one token: no tail


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from dppo.runtime.models import char_tokenizer, save_model, tiny_random_model

    tok = char_tokenizer()
    model = tiny_random_model(tok, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.2, seed=0)
    return save_model(model, tok, tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_run_diagnose_end_to_end(tiny_folder, tmp_path, engine_dtype):
    from dppo.studies.diagnose.run import run_diagnose

    report = run_diagnose(str(tiny_folder), engine="hf", engine_dtype=engine_dtype, task="addition",
                          task_options={"digits": 1}, n_prompts=4, n=2, max_new_tokens=8, top_k=5, out_dir=tmp_path)
    mean_diff = report["overall"]["binary_tv"]["mean"]
    if engine_dtype == "float32":
        assert mean_diff < 1e-5  # same weights, same dtype: only kernel-order rounding differs
    else:
        assert mean_diff > 0
    assert report["num_responses"] == 8 and report["num_tokens"] > 0
    assert report["overall"]["topk_coverage"]["max"] <= 1 + 1e-6
    on_disk = json.loads((tmp_path / "diagnose.json").read_text())
    assert on_disk["overall"]["count"] == report["overall"]["count"]
    for name in ("ratio_vs_tv.png", "histograms.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(b["count"] for b in report["buckets"]) == report["num_tokens"]
    assert math.isfinite(report["overall"]["ratio_minus_1"]["mean"])


def test_cmd_diagnose_prints_table(tiny_folder, tmp_path, capsys):
    from dppo.studies.diagnose.cli import cmd_diagnose

    rc = cmd_diagnose(["--model", str(tiny_folder), "--engine", "hf", "--task", "addition", "--task-options",
                       '{"digits": 1}', "--n-prompts", "2", "--n", "2", "--max-new-tokens", "4", "--top-k", "0",
                       "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "µ bucket" in out and "all" in out and str(tmp_path / "diagnose.json") in out
    assert cmd_diagnose(["--model", str(tiny_folder), "--task-options", "[1]"]) == 2


def test_pair_stats_by_hand():
    from dppo.studies.diagnose.mismatch import pair_stats

    mu = torch.tensor([[0.5, 0.5, 0.5, 0.2]]).log()
    pi = torch.tensor([[0.5, 0.56, 0.44, 0.9]]).log()  # ratios 1, 1.12, 0.88, 4.5; TV 0, .06, .06, .7 (last: padding)
    mask = torch.tensor([[True, True, True, False]])
    got = pair_stats(pi, mu, mask)
    assert got["tokens"] == 3 and got["out_0.9_1.1"] == pytest.approx(2 / 3)
    assert got["binary_tv_mean"] == pytest.approx(0.04, abs=1e-6) and got["tv_over_delta"] == 0.0
    assert pair_stats(pi, mu, torch.ones_like(mask))["tv_over_delta"] == pytest.approx(0.25)


def test_run_diagnose_across_precision_pairs_and_batch_shapes(tiny_folder, tmp_path, capsys):
    """Two engine dtypes × three trainer precisions: one row per pair. The fp32 trainer against the fp32 engine
    differs by kernel order only; bf16 autocast against the fp32 engine is far more (its matmuls round to 8 bits),
    fp16 ~8x less; scoring one response at a time changes the fp32 trainer's log-probs by rounding only."""
    from dppo.studies.diagnose.cli import cmd_diagnose
    from dppo.studies.diagnose.run import run_diagnose

    report = run_diagnose(str(tiny_folder), engine="hf", engine_dtype="float32,bfloat16",
                          trainer_precision=["fp32", "bf16", "fp16"], batch_shape=True, task="addition",
                          task_options={"digits": 1}, n_prompts=4, n=2, max_new_tokens=8, top_k=0, out_dir=tmp_path)
    pairs = {(r["engine_dtype"], r["trainer_precision"]): r for r in report["precision_pairs"]}
    assert list(pairs) == [(e, t) for e in ("float32", "bfloat16") for t in ("fp32", "bf16", "fp16")]
    assert pairs[("float32", "fp32")]["binary_tv_mean"] < 1e-5
    # bf16 keeps 3 fewer mantissa bits than fp16: ~8x the rounding (measured 8.8x here)
    assert pairs[("float32", "bf16")]["binary_tv_mean"] > 4 * pairs[("float32", "fp16")]["binary_tv_mean"] > 0
    assert report["config"]["trainer_precision"] == "fp32" and report["config"]["engine_dtype"] == "float32"
    shapes = {r["trainer_precision"]: r for r in report["batch_shape"]}
    assert set(shapes) == {"fp32", "bf16", "fp16"} and shapes["fp32"]["binary_tv_mean"] < 1e-5
    assert all(r["tokens"] == report["num_tokens"] for r in report["precision_pairs"] + report["batch_shape"])
    with pytest.raises(ValueError, match=r"^trainer_precision: expected one or more of fp32, bf16, fp16"):
        run_diagnose(str(tiny_folder), engine="hf", trainer_precision="fp8", out_dir=tmp_path)
    rc = cmd_diagnose(["--model", str(tiny_folder), "--engine", "hf", "--task", "addition", "--task-options",
                       '{"digits": 1}', "--n-prompts", "2", "--n", "2", "--max-new-tokens", "4", "--top-k", "0",
                       "--engine-dtype", "float32", "--trainer-precision", "fp32,bf16", "--batch-shape",
                       "--out-dir", str(tmp_path / "cli")])
    out = capsys.readouterr().out
    assert rc == 0 and "out 0.9-1.1" in out and "1 vs all" in out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("float32 ")] == [["float32", "fp32"], ["float32", "bf16"]]
