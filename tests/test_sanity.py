"""`dppo sanity` (paper Fig. 3 in miniature): the summary functions on hand-made rows, and the 1-seed 2-method
short version end to end (JSON + PNG written, table rows present, metrics finite)."""

import json
import math

import pytest

from dppo.config import Config
from dppo.presets import PRESETS
from dppo.sanity import (SANITY_METHODS, cmd_sanity, format_table, is_collapsed, run_sanity, sanity_config,
                         steps_to_accuracy, summarize_method, summarize_run)


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


def test_summaries_and_table():
    rows = rows_from([0.2, 0.4, 0.6, 0.8, 0.9, 0.92, 0.95, 0.96], tv=[0.01, 0.02, 0.05, 0.03, 0.02, 0.02, 0.02, 0.02],
                     masked=[0.1] * 8)
    s = summarize_run(rows)
    assert s["steps_to_90"] == 5 and s["max_mismatch"] == 0.05 and not s["collapsed"]
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
                                   "dppo-topk-tv", "dppo-topk-kl", "dppo-recompute"}
    for name, loss in SANITY_METHODS.items():
        preset = PRESETS[name][0]().loss
        for key, value in loss.items():
            assert getattr(preset, key) == value, (name, key)
    assert math.isinf(SANITY_METHODS["pg-is"]["is_cap"]) and SANITY_METHODS["cispo"]["is_cap"] == 3.0
    assert SANITY_METHODS["minirl"]["anchor"] == "recompute" and SANITY_METHODS["dppo-recompute"]["anchor"] == "recompute"
    cfg = sanity_config("m", "r", "dppo-topk-kl", 1, steps=7, lr=1e-3, prompts_per_step=8, group_size=4)
    assert isinstance(cfg, Config)
    assert cfg.rollout.top_k_logprobs == 20 and cfg.rollout.dtype == "bfloat16" and cfg.model.dtype == "float32"
    assert cfg.rollout.engine == "hf" and cfg.train.mini_batches == 4 and cfg.train.seed == 1 and cfg.train.steps == 7
    assert not cfg.log.tensorboard and not cfg.log.progress and not cfg.train.eval_before
    assert sanity_config("m", "r", "pg-is", 0).rollout.top_k_logprobs == 0
    with pytest.raises(ValueError, match="unknown"):
        sanity_config("m", "r", "nope", 0)


def test_short_study_writes_json_png_table(tmp_path, capsys):
    report = run_sanity(["dppo-binary-tv", "pg-is"], [0], tmp_path, steps=3, prompts_per_step=8, group_size=4,
                        mini_batches=4, hidden=64, sft_steps=20, eval_size=8)
    assert (tmp_path / "sanity.png").stat().st_size > 1000
    data = json.loads((tmp_path / "sanity.json").read_text())
    assert set(data["methods"]) == {"dppo-binary-tv", "pg-is"}
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
