"""`dppo sanity` (paper Fig. 3 in miniature): the summary functions on hand-made rows, the 1-seed 2-method
short version end to end (JSON + PNG written, table rows present, metrics finite), and the `reverse` task's
study (responses of >= 16 tokens)."""

import json
import math
from pathlib import Path

import pytest

from dppo.train.config import Config, ConfigError, LossConfig
from dppo.train.presets import PRESETS
from dppo.studies.sanity import (METHOD_GROUPS, SANITY_METHODS, LogitNoise, SanityConfig, cmd_sanity, expand_methods,
                                 format_table, is_collapsed, method_loss, run_sanity, sanity_config, steps_to_accuracy,
                                 summarize_method, summarize_run)


def rows_from(acc, zero=None, tv=None, masked=None):
    zero = zero or [0.0] * len(acc)
    tv = tv or [0.01] * len(acc)
    masked = masked or [0.0] * len(acc)
    return [{"step": i + 1, "reward/accuracy": a, "reward/mean": a, "advantage/zero_group_frac": z,
             "mismatch/binary_tv_mean": t, "trust_region/masked_frac": m}
            for i, (a, z, t, m) in enumerate(zip(acc, zero, tv, masked))]


def test_steps_to_accuracy():
    assert steps_to_accuracy(rows_from([0.1, 0.5, 0.89, 0.9, 0.95])) == 4
    assert steps_to_accuracy(rows_from([0.1, 0.5, 0.89])) is None
    assert steps_to_accuracy(rows_from([0.1, 0.7]), target=0.6) == 2


def test_collapse_by_drop_from_peak():
    rising = [0.2 + 0.05 * i for i in range(12)]  # 0.2 -> 0.75, never drops
    assert is_collapsed(rows_from(rising)) == (False, "")
    collapsed, reason = is_collapsed(rows_from([0.4] * 10 + [0.1] * 5))
    assert collapsed and "peak" in reason
    # one lucky first step is not a peak: the running mean is over full 5-step windows
    assert not is_collapsed(rows_from([0.35] + [0.1] * 14))[0]
    # a noisy plateau at a low level is not a collapse (the drop must be >= 0.05)
    assert not is_collapsed(rows_from([0.06, 0.02, 0.06, 0.02, 0.06, 0.01, 0.02, 0.01, 0.02, 0.01]))[0]


def test_collapse_by_dead_groups():
    acc = [0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    zero = [0.2, 0.5, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    collapsed, reason = is_collapsed(rows_from(acc, zero=zero))
    assert collapsed and "zero-advantage" in reason and "step 4" in reason
    # all groups zero-advantage because all answers are right is success, not collapse
    assert not is_collapsed(rows_from([1.0] * 8, zero=[1.0] * 8))[0]
    # four dead steps are not enough
    assert not is_collapsed(rows_from([0.3] * 5 + [0.3] * 4, zero=[0.0] * 5 + [1.0] * 4))[0]
    # five dead steps, then a stale engine brings a gradient back and the run climbs to 0.6: not a collapse
    acc, zero = [0.9] * 5 + [0.45] * 5 + [0.6] * 10, [0.0] * 5 + [1.0] * 5 + [0.0] * 10
    assert not is_collapsed(rows_from(acc, zero=zero))[0]


def test_summaries_and_table():
    rows = rows_from([0.2, 0.4, 0.6, 0.8, 0.9, 0.92, 0.95, 0.96], tv=[0.01, 0.02, 0.05, 0.03, 0.02, 0.02, 0.02, 0.02],
                     masked=[0.1] * 8)
    s = summarize_run(rows)
    assert s["steps_to_90"] == 5 and s["max_mismatch"] == 0.05 and not s["collapsed"]
    assert s["initial_mismatch"] == pytest.approx(0.13 / 5) and s["final_mismatch"] == pytest.approx(0.11 / 5)
    assert s["final_accuracy"] == pytest.approx((0.9 + 0.92 + 0.95 + 0.96 + 0.8) / 5)
    assert s["initial_accuracy"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.8 + 0.9) / 5)
    assert s["masked_frac"] == pytest.approx(0.1)
    other = summarize_run(rows_from([0.4] * 10 + [0.1] * 5))
    m = summarize_method([{**s, "seconds": 1.0}, {**other, "seconds": 3.0}])
    assert m["collapsed"] == 1 and m["reached_90"] == 1 and m["steps_to_90"] == 5 and m["seconds"] == 2.0
    table = format_table({"x": {"summary": m}})
    assert table.splitlines()[1].startswith("x ") and "1/2" in table


def test_methods_follow_presets():
    assert set(SANITY_METHODS) == {"pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl",
                                   "dppo-topk-tv", "dppo-topk-kl", "dppo-recompute",
                                   "grpo-relax-high", "grpo-relax-low", "grpo-relax-both", "pg-is-neg-mask",
                                   "dppo-stale-tv", "dppo-sat-tv", "dppo-seq-max", "dppo-seq-k3",
                                   "icepop", "gspo", "geo-mask", "tis"}
    for name, loss in SANITY_METHODS.items():
        preset = PRESETS[name][0]().loss
        for key, value in loss.items():
            assert getattr(preset, key) == value, (name, key)
    assert math.isinf(SANITY_METHODS["pg-is"]["is_cap"]) and SANITY_METHODS["cispo"]["is_cap"] == 3.0
    assert SANITY_METHODS["minirl"]["anchor"] == "recompute" and SANITY_METHODS["dppo-recompute"]["anchor"] == "recompute"
    cfg = sanity_config(SanityConfig(steps=7, lr=1e-3, prompts_per_step=8, group_size=4), "m", "r", "dppo-topk-kl", 1)
    assert isinstance(cfg, Config)
    assert cfg.top_k_logprobs == 20 and cfg.rollout.engines[0].dtype == "bfloat16" and cfg.model.dtype == "float32"
    assert cfg.model.precision == "fp32"  # the fp32 trainer on every CPU: the study's mismatch is its own source
    assert cfg.rollout.engines[0].kind == "hf" and cfg.train.mini_batches == 4 and cfg.train.seed == 1 and cfg.train.steps == 7
    assert cfg.log.trackers == () and not cfg.log.progress and not cfg.train.eval_before
    assert sanity_config(SanityConfig(), "m", "r", "pg-is", 0).top_k_logprobs == 0
    with pytest.raises(ValueError, match="unknown"):
        sanity_config(SanityConfig(), "m", "r", "nope", 0)


def test_short_study_writes_json_png_table(tmp_path, capsys):
    report = run_sanity(SanityConfig(methods=("dppo-binary-tv", "pg-is"), seeds=(0,), out_dir=str(tmp_path), steps=3,
                                     prompts_per_step=8, group_size=4, mini_batches=4, hidden=64, sft_steps=20,
                                     eval_size=8))
    assert (tmp_path / "sanity.png").stat().st_size > 1000
    data = json.loads((tmp_path / "sanity.json").read_text())
    assert set(data["methods"]) == {"dppo-binary-tv", "pg-is"}
    assert data["settings"]["methods"] == ["dppo-binary-tv", "pg-is"] and data["settings"]["seeds"] == [0]
    assert data["settings"]["lr"] == 3e-4 and data["settings"]["task_options"] == {"digits": 1}  # resolved per task
    for name, m in data["methods"].items():
        s = m["summary"]
        for key in ("final_accuracy", "max_mismatch", "final_mismatch", "masked_frac"):
            assert s[key] is not None and math.isfinite(s[key]), (name, key)
        assert m["per_seed"][0]["steps"] == 3
        assert len(m["curves"]["reward/mean"]["step"]) == 3
        assert m["curves"]["mismatch/binary_tv_mean"]["mean"][0] > 0  # bf16 engine vs fp32 trainer: a real mismatch
    # same starting model for both methods: identical first-step rollouts (same seed), so identical accuracy
    first = [m["curves"]["reward/mean"]["mean"][0] for m in data["methods"].values()]
    assert first[0] == first[1]
    out = capsys.readouterr().out
    table = report["table"].splitlines()
    assert table[1].startswith("dppo-binary-tv") and table[2].startswith("pg-is")
    assert "dppo-binary-tv" in out and "pg-is seed 0" in out


def test_cmd_quick_and_errors(tmp_path):
    assert cmd_sanity(["--quick", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "sanity.json").is_file()
    assert cmd_sanity(["--methods", "bogus", "--out-dir", str(tmp_path / "x")]) == 2
    assert cmd_sanity(["--seeds", "a,b", "--out-dir", str(tmp_path / "y")]) == 2


def test_cli_reads_comma_lists_and_rejects_a_bad_value_in_one_line(capsys):
    from dppo.studies.sanity import parse_args

    assert parse_args([]) == SanityConfig()
    cfg = parse_args(["--methods", "key,dppo-binary-tv:delta=0.1", "--seeds", "0,1,2", "--steps", "7", "--lr", "1e-3",
                      "--task", "reverse", "--min-len", "16", "--max-len", "24", "--mini-batches", "2",
                      "--sft-steps", "9", "--mismatch", "lag:2", "--out-dir", "x"])
    assert cfg.methods == ("key", "dppo-binary-tv:delta=0.1") and cfg.seeds == (0, 1, 2)
    assert (cfg.steps, cfg.lr, cfg.task, cfg.min_len, cfg.max_len, cfg.mini_batches, cfg.sft_steps, cfg.out_dir) == (
        7, 1e-3, "reverse", 16, 24, 2, 9, "x")
    resolved = cfg.resolve()
    assert resolved.methods == (*METHOD_GROUPS["key"], "dppo-binary-tv:delta=0.1")
    assert (resolved.engine_lag, resolved.engine_dtype, resolved.max_new_tokens) == (2, "float32", 26)
    assert resolved.resolve() == resolved
    noisy = parse_args(["--engine-dtype", "float32", "--logit-noise", "0.5"])
    assert (noisy.engine_dtype, noisy.logit_noise) == ("float32", 0.5)
    quick = parse_args(["--quick", "--steps", "50"]).resolve()
    assert (quick.methods, quick.seeds, quick.steps, quick.sft_steps) == (("dppo-binary-tv", "pg-is"), (0,), 5, 30)
    # a value the config rejects: exit 2, one line naming the field
    for argv, line in [(["--steps", "0"], "steps: expected >= 1, got 0"),
                       (["--methods", "pg-is,bogus"], "methods: unknown 'bogus'; valid: pg-is, cispo"),
                       (["--methods", "dppo-binary-tv:delta=-1"], "methods: method 'dppo-binary-tv:delta=-1': loss.delta_low"),
                       (["--seeds", "1,1"], "seeds: expected one or more distinct seeds, got (1, 1)"),
                       (["--logit-noise", "-1"], "logit_noise: expected a finite value >= 0, got -1.0"),
                       (["--lr", "0"], "lr: expected a finite value > 0, got 0.0"),
                       (["--mismatch", "lag:0"], "--mismatch: expected one of none, bf16")]:
        assert cmd_sanity(argv) == 2, argv
        out = capsys.readouterr()
        assert out.out.startswith(f"dppo sanity: error: {line}") and out.out.count("\n") == 1 and not out.err, out
    # a value tyro cannot read: exit 2, tyro's message naming the flag
    assert cmd_sanity(["--seeds", "0,x"]) == 2
    assert "--seeds" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- ablations
def test_relax_presets_are_sanity_methods_on_request():
    assert METHOD_GROUPS["all"] == ("pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl",
                                    "dppo-topk-tv", "dppo-topk-kl", "dppo-recompute")  # the default: no relax runs
    assert expand_methods(["relax"]) == ["grpo-clip-higher", "grpo-relax-high", "grpo-relax-low", "grpo-relax-both"]
    for side in ("high", "low", "both"):
        loss = SANITY_METHODS[f"grpo-relax-{side}"]
        assert {k: v for k, v in loss.items() if k != "relax_side"} == {
            "trust_region": "ppo_clip_relax", "anchor": "rollout", "is_cap": 10.0, "eps_low": 0.2, "eps_high": 0.28,
            "relax_alpha": 0.1}
        assert LossConfig(**loss).relax_side == side
        assert PRESETS[f"grpo-relax-{side}"][0]().loss.relax_side == side
        cfg = sanity_config(SanityConfig(), "m", "r", f"grpo-relax-{side}", 0)
        assert cfg.loss.trust_region == "ppo_clip_relax" and cfg.loss.relax_side == side and cfg.loss.relax_alpha == 0.1


def test_method_specs_override_loss_fields():
    assert method_loss("dppo-binary-tv:delta=0.1") == {**SANITY_METHODS["dppo-binary-tv"], "delta_low": 0.1,
                                                       "delta_high": 0.1}
    loss = method_loss("grpo-clip-higher:eps=0.3:is_cap=inf")
    assert loss["eps_low"] == loss["eps_high"] == 0.3 and math.isinf(loss["is_cap"])
    assert sanity_config(SanityConfig(), "m", "r", "dppo-binary-kl:delta=0.15", 0).loss.delta_high == 0.15
    deltas = [(method_loss(m)["trust_region"], method_loss(m).get("delta_high")) for m in expand_methods(["delta"])]
    assert deltas == [("dppo_binary_tv", 0.1), ("dppo_binary_tv", None), ("dppo_binary_tv", 0.2),
                      ("dppo_binary_kl", None), ("dppo_binary_kl", 0.1), ("dppo_binary_kl", 0.15)]
    assert expand_methods(["key", "pg-is", "dppo-topk-tv"])[-1] == "dppo-topk-tv" and len(expand_methods(["key"])) == 6
    for bad, match in [("nope", "unknown 'nope'"), ("dppo-binary-tv:foo=1", "foo=1"), ("dppo-binary-tv:delta", "delta"),
                       ("dppo-binary-tv:delta=-1", "loss.delta_low: expected > 0")]:
        with pytest.raises(ValueError, match=match):
            expand_methods([bad])


# ---------------------------------------------------------------------------------------------- the mismatch knob
@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    """A small supervised warm start (as the study uses, smaller): peaked, addition-shaped distributions."""
    from dppo.runtime.models import load_model, load_tokenizer
    from dppo.studies.sanity import warm_start

    folder = warm_start(tmp_path_factory.mktemp("warm"), hidden=64, sft_steps=20)
    return load_model(folder), load_tokenizer(folder)


def _noisy_rollouts(warm_model, sigma, *, seed=0, n=16, T=4):
    """Rollouts of the fp32 warm-start model from an fp32 hf engine through LogitNoise(sigma) for 24 addition
    prompts, and π (the unperturbed model's log-probs of the same tokens, scored independently by the trainer's
    scorer)."""
    import torch

    from dppo.rollout import SamplingParams, make_engine
    from dppo.train.batch import collate
    from dppo.train.scoring import score_responses

    model, tok = warm_model
    engine = make_engine("hf", model=model, tokenizer=tok, dtype="float32", seed=0)
    noise = LogitNoise(engine.model, sigma, seed=seed, record=True)
    texts = [f"{a}+{b}=" for a in range(6) for b in range(4)]
    ro = engine.generate([tok(t)["input_ids"] for t in texts], SamplingParams(n=n, max_new_tokens=T, seed=seed))
    batch = collate(ro, pad_id=tok.pad_token_id)
    with torch.no_grad():
        pi = score_responses(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                             pad_id=tok.pad_token_id).logp
    return batch, pi, noise


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_logit_noise_produces_the_stated_mismatch_and_records_mu_honestly(warm_model, sigma):
    import torch

    batch, pi, noise = _noisy_rollouts(warm_model, sigma)
    mask = batch.response_mask
    mu = batch.rollout_logp
    # the exact E_{a~µ}|π(a) − µ(a)| of every sampled position, from the hook's full distributions: [T, B] -> [B, T]
    # (the first call is the prefill over the 24 distinct prompts, whose logits the engine shares by the n = 16 rows)
    first, *rest = noise.expected_tv
    assert first.shape == (24,) and all(r.shape == (24 * 16,) for r in rest)
    expected = torch.stack([first.repeat_interleave(16), *rest]).T[:, : mask.shape[1]]
    stated = expected[mask].mean()
    # Monte Carlo over the sampled tokens with π from the independent scorer and µ as recorded by the engine
    diff = (pi.exp() - mu.exp()).abs()[mask]
    se = diff.std() / diff.numel() ** 0.5
    assert abs(diff.mean() - stated) < 4 * se + 1e-4, (float(diff.mean()), float(stated), float(se))
    assert float(se) < 0.1 * float(stated)  # the comparison is tight: the SE is small against the mismatch
    # importance-sampling identity E_{a~µ}[π(a)/µ(a)] = 1 holds only if µ is the distribution actually sampled
    ratio = (pi - mu).exp()[mask]
    assert abs(ratio.mean() - 1) < 4 * ratio.std() / ratio.numel() ** 0.5
    # the knob's scale on this small warm start (measured: 0.008 at σ = 0.5, 0.025 at σ = 1; a random model,
    # nearly uniform over ~96 characters, gives ~0.005 at σ = 0.5): within a factor 2
    lo, hi = {0.5: (0.004, 0.016), 1.0: (0.0125, 0.05)}[sigma]
    assert lo < float(stated) < hi, float(stated)
    print(f"sigma {sigma}: stated {float(stated):.4f}, measured {float(diff.mean()):.4f} +- {float(se):.4f}")


def test_logit_noise_off_is_exact_and_noise_is_seeded(warm_model):
    import torch

    clean, pi, noise = _noisy_rollouts(warm_model, 0.0)
    assert noise.expected_tv == []  # σ = 0: the hook passes the logits through untouched
    assert (pi - clean.rollout_logp).abs()[clean.response_mask].max() < 1e-5  # fp32 engine, no noise: µ = π
    a, _, _ = _noisy_rollouts(warm_model, 1.0, seed=5)
    b, _, _ = _noisy_rollouts(warm_model, 1.0, seed=5)
    c, _, _ = _noisy_rollouts(warm_model, 1.0, seed=6)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)
    assert not torch.equal(a.rollout_logp, c.rollout_logp)
    with pytest.raises(ValueError, match="logit_noise"):
        LogitNoise(torch.nn.Linear(2, 2), -1.0)


def test_noisy_study_logs_the_injected_mismatch_against_a_clean_control(tmp_path):
    kw = dict(methods=("grpo-clip-higher",), seeds=(0,), steps=2, prompts_per_step=8, group_size=4, mini_batches=2,
              hidden=64, sft_steps=20, eval_size=8)
    control = run_sanity(SanityConfig(out_dir=str(tmp_path / "c"), engine_dtype="float32", logit_noise=0.0, **kw),
                         verbose=False)
    noisy = run_sanity(SanityConfig(out_dir=str(tmp_path / "n"), engine_dtype="float32", logit_noise=1.0, **kw),
                       verbose=False)
    c = control["methods"]["grpo-clip-higher"]["summary"]
    n = noisy["methods"]["grpo-clip-higher"]["summary"]
    assert c["max_mismatch"] < 1e-5  # fp32 engine, no noise: the logged |π−µ| is numerical only
    assert 0.03 < n["max_mismatch"] < 0.2  # σ = 1: the trainer logs the injected mismatch
    assert noisy["settings"]["logit_noise"] == 1.0 and control["settings"]["engine_dtype"] == "float32"
    # evaluation samples without the noise, training rollouts with it
    from dppo.studies.sanity import NoisyRolloutTrainer

    cfg = sanity_config(SanityConfig(steps=1, prompts_per_step=4, group_size=2, mini_batches=1, eval_size=8),
                        noisy["settings"]["warm_start"], tmp_path / "t", "pg-is", 0)
    trainer = NoisyRolloutTrainer(cfg, tmp_path / "t", logit_noise=1.0, noise_seed=0)
    try:
        trainer.noise.record = True
        assert trainer.evaluate()["pass@1"] >= 0 and trainer.noise.expected_tv == [] and trainer.noise.enabled
        trainer.step()
        assert len(trainer.noise.expected_tv) >= 2
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="logit_noise"):
        run_sanity(SanityConfig(out_dir=str(tmp_path / "x"), logit_noise=-1.0, **kw))


def test_mismatch_sources_and_the_fig5_group():
    from dppo.studies.sanity import parse_mismatch

    assert parse_mismatch("none") == {"engine_dtype": "float32", "logit_noise": 0.0, "quantization": "none", "engine_lag": 0}
    assert parse_mismatch("bf16")["engine_dtype"] == "bfloat16"
    assert parse_mismatch("fp8")["quantization"] == "fp8" and parse_mismatch("fp8")["engine_dtype"] == "float32"
    assert parse_mismatch("lag:3")["engine_lag"] == 3 and parse_mismatch("noise:0.5")["logit_noise"] == 0.5
    for bad in ("fp16", "lag:0", "lag:x", "noise:0", "noise:inf", "fp8:1", ""):
        with pytest.raises(ValueError, match=r"^--mismatch: expected one of none, bf16, fp8, lag:K, noise:SIGMA"):
            parse_mismatch(bad)
    fig5 = expand_methods(["fig5"])
    assert fig5[0] == "pg-is" and len(fig5) == 5
    assert method_loss("pg-is-neg-mask:neg_delta=0.8:anchor=recompute") == {
        **SANITY_METHODS["pg-is-neg-mask"], "neg_delta": 0.8, "anchor": "recompute"}
    cfg = sanity_config(SanityConfig(**parse_mismatch("lag:2")), "m", "r", "pg-is-neg-mask", 0)
    assert cfg.rollout.engines[0].lag == 2 and cfg.rollout.engines[0].dtype == "float32" and cfg.loss.trust_region == "pg_is_neg_mask"


# ---------------------------------------------------------------------------------------------- long responses
def test_reverse_task_config_and_warm_start_cache_key(tmp_path):
    from dppo.studies.sanity import default_max_new_tokens, task_options, warm_start

    cfg = sanity_config(SanityConfig(), "m", "r", "pg-is", 0)
    assert cfg.task.name == "addition" and json.loads(cfg.task.options) == {"digits": 1}
    assert cfg.rollout.max_new_tokens == 4  # the addition study as before
    cfg = sanity_config(SanityConfig(task="reverse"), "m", "r", "pg-is", 0)
    assert cfg.task.name == "reverse" and json.loads(cfg.task.options) == {"min_len": 16, "max_len": 20}
    assert cfg.rollout.max_new_tokens == 22  # the longest answer, EOS and one token of slack
    assert cfg.optim.lr == 1e-4 and sanity_config(SanityConfig(), "m", "r", "pg-is", 0).optim.lr == 3e-4  # per task
    longer = sanity_config(SanityConfig(task="reverse", min_len=16, max_len=30), "m", "r", "pg-is", 0)
    assert longer.rollout.max_new_tokens == 32
    assert default_max_new_tokens("reverse", task_options("reverse", max_len=24)) == 26
    with pytest.raises(ValueError, match=r"task: expected one of addition, reverse, got 'nope'"):
        sanity_config(SanityConfig(task="nope"), "m", "r", "pg-is", 0)
    # the warm-start cache key includes the task and its options
    kw = dict(hidden=32, sft_steps=1, size=8, eval_size=2)
    folders = [warm_start(tmp_path, **kw), warm_start(tmp_path, task="reverse", **kw),
               warm_start(tmp_path, task="reverse", options={"min_len": 16, "max_len": 18}, **kw)]
    assert len(set(folders)) == 3
    info = json.loads((folders[2] / "warm_start.json").read_text())
    assert info["task"] == "reverse" and info["options"] == {"min_len": 16, "max_len": 18} and info["batch_size"] == 32
    assert warm_start(tmp_path, task="reverse", **kw) == folders[1]  # cached


def test_reverse_study_trains_on_responses_of_at_least_16_tokens(tmp_path):
    from dppo.train.plot import read_metrics

    # a small warm start (hidden 64, 100 SFT steps) already answers with the answer's length (16-20 digits + EOS)
    report = run_sanity(SanityConfig(methods=("pg-is",), seeds=(0,), out_dir=str(tmp_path), task="reverse", steps=2,
                                     prompts_per_step=8, group_size=4, mini_batches=2, hidden=64, sft_steps=100,
                                     eval_size=8), verbose=False)
    settings = report["settings"]
    assert settings["task"] == "reverse" and settings["task_options"] == {"min_len": 16, "max_len": 20}
    assert settings["max_new_tokens"] == 22
    rows = read_metrics(tmp_path / "pg-is-seed0")
    assert len(rows) == 2
    for r in rows:
        assert r["response/length_mean"] >= 16 and r["response/length_max"] <= 22, r
    summary = report["methods"]["pg-is"]["summary"]
    assert summary["max_mismatch"] is not None and math.isfinite(summary["max_mismatch"])
    assert cmd_sanity(["--task", "reverse", "--min-len", "0", "--out-dir", str(tmp_path / "bad")]) == 2


def test_trough_recovery_and_masked_by_staleness():
    from dppo.studies.sanity.summary import summarize_method, trough_and_recovery

    # drop from 0.99 to a 5-step trough of 0.75 in the first 100 steps, end at 0.87: half way back to 0.95
    acc = [0.99] * 5 + [0.75] * 10 + [0.85] * 200 + [0.87] * 5
    out = trough_and_recovery(acc)
    assert out["trough_accuracy"] == pytest.approx(0.75) and out["recovery"] == pytest.approx(0.6)
    assert trough_and_recovery([0.97] * 20)["recovery"] is None  # never below 95%: nothing to recover from
    # a trough after step 100 is not the lag's initial drop
    assert trough_and_recovery([0.9] * 100 + [0.1] * 10 + [0.9] * 5)["trough_accuracy"] == pytest.approx(0.9)
    rows = rows_from([0.5] * 6)
    for i, r in enumerate(rows):
        r["trust_region/masked_frac_stale_4" if i >= 2 else f"trust_region/masked_frac_stale_{i}"] = 0.01 * (i + 1)
    s = summarize_run(rows)
    assert s["masked_by_staleness"] == {"0": 0.01, "1": 0.02, "4": pytest.approx((0.03 + 0.04 + 0.05 + 0.06) / 4)}
    assert s["seq_removed_pos"] is None  # not logged by this run
    m = summarize_method([s, {**s, "masked_by_staleness": {"4": 0.09}}])
    assert m["masked_by_staleness"]["4"] == pytest.approx((0.045 + 0.09) / 2) and m["masked_by_staleness"]["0"] == 0.01


def test_feedback_study_trains_multi_turn_episodes_under_a_stale_engine(tmp_path):
    from dppo.train.plot import read_metrics

    kw = dict(methods=("dppo-binary-tv:sequence_mask=max_divergence:sequence_unit=turn",), seeds=(0,), steps=3,
              prompts_per_step=4, group_size=4, mini_batches=2, hidden=64, sft_steps=20, eval_size=4, env="feedback",
              engine_lag=1)
    report = run_sanity(SanityConfig(out_dir=str(tmp_path), **kw), verbose=False)
    settings = report["settings"]
    assert settings["env"] == "feedback" and settings["max_turns"] == 3
    warm = json.loads((Path(settings["warm_start"]) / "warm_start.json").read_text())
    assert warm["env"] == "feedback"  # the agent SFT warm start, cached apart from the single-turn one
    rows = read_metrics(tmp_path / "dppo-binary-tv_sequence_maskmax_divergence_sequence_unitturn-seed0")
    assert len(rows) == 3
    assert all(r["episode/turns_mean"] >= 1.0 and r["episode/env_token_frac"] > 0 for r in rows)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("trust_region/seq_removed_frac_pos" in r for r in rows)
    with pytest.raises(ConfigError, match="^env: "):
        SanityConfig(env="calculator")
    with pytest.raises(ConfigError, match="^max_turns: expected >= 1"):
        SanityConfig(env="feedback", max_turns=0)
