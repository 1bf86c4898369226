"""`dppo sanity report`: merging split studies, the control check, the mismatch-by-part means (hand-computed), and
the command end to end on real short studies (the rows equal the summaries `dppo sanity` wrote)."""

import json

import pytest

from dppo.studies.sanity import SanityConfig, cmd_sanity, run_sanity, study_settings, summarize_method, summarize_run
from dppo.studies.sanity.report import (TARGET_FINAL, check_control, load_study, method_row, mismatch_by_part,
                                        report_table)


def test_mismatch_by_part_hand_computed():
    curve = {"mean": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    assert mismatch_by_part(curve, 4) == [1.5, 3.5, 5.5, 8.0]  # the last span takes the remainder (7, 8, 9)
    assert mismatch_by_part(curve, 1) == [5.0]
    assert mismatch_by_part({"mean": [0.2, 0.4]}, 2) == [0.2, 0.4]
    with pytest.raises(ValueError, match="parts"):
        mismatch_by_part({"mean": [1.0, 2.0]}, 3)


def _method(finals, tv_curve, collapsed=0, first_seed=0):
    rows = [[{"step": i + 1, "reward/accuracy": f, "mismatch/binary_tv_mean": t, "trust_region/masked_frac": 0.02}
             for i, t in enumerate(tv_curve)] for f in finals]
    per_seed = [{**summarize_run(r), "seed": first_seed + k, "seconds": 1.0, "eval_pass@1": None}
                for k, r in enumerate(rows)]
    summary = summarize_method(per_seed)
    summary["collapsed"] = collapsed
    curve = {"step": list(range(1, len(tv_curve) + 1)), "mean": tv_curve, "min": tv_curve, "max": tv_curve}
    return {"loss": {"trust_region": "none"}, "summary": summary, "per_seed": per_seed,
            "curves": {"mismatch/binary_tv_mean": curve}}


def _write(folder, methods, **overrides):
    settings = {"task": "addition", "steps": 8, "lr": 3e-4, "sft_steps": 60, "engine_dtype": "float32",
                "logit_noise": 0.0, "quantization": "none", "engine_lag": 4, "seeds": [0, 1], "warm_start": str(folder)}
    settings.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sanity.json").write_text(json.dumps({"settings": settings, "methods": methods, "wall_s": 10.0}))
    return folder


def test_merge_rows_and_control(tmp_path):
    tv = [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]
    a = _write(tmp_path / "a", {"pg-is": _method([0.2, 0.4], tv, collapsed=2)})
    b = _write(tmp_path / "b", {"dppo-binary-tv": _method([0.96, 0.94], [0.1] * 8)}, seeds=[0, 1])
    ctrl = _write(tmp_path / "c", {"pg-is": _method([0.96, 0.8], [0.0] * 8)}, engine_lag=0)
    study, control = load_study([a, b]), load_study([ctrl])
    assert list(study["methods"]) == ["pg-is", "dppo-binary-tv"] and study["wall_s"] == [10.0, 10.0]
    check_control(study, control)  # differs only in engine_lag: accepted
    row = method_row(study["methods"]["pg-is"])
    assert row["mismatch_parts"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert (row["min"], row["max"], row["collapsed"], row["at_target"]) == (0.2, 0.4, 2, 0)
    assert method_row(study["methods"]["dppo-binary-tv"])["at_target"] == 1  # 0.96 >= TARGET_FINAL > 0.94
    assert 0.94 < TARGET_FINAL <= 0.96
    table = report_table(study, control).splitlines()
    assert table[2].startswith("| pg-is | 0.880 | 1/2 | 0/2 | 0.300 (0.20–0.40) | 2/2 |")
    assert "| 0.20 0.40 |" in table[2]  # per seed; _method's rows never collapse (the summary's count is set apart)
    assert "0.100 → 0.200 → 0.300 → 0.400" in table[2]
    assert table[3].startswith("| dppo-binary-tv | - | - | - | 0.950 (0.94–0.96) | 0/2 |")


def test_masked_share_by_advantage_sign_hand_computed(tmp_path):
    # seed 0 masks 10% then 30% of its A>0 tokens (mean 20%), seed 1 40% twice; A<0: 5% and 15%, 25% twice
    rows = [[{"step": i + 1, "reward/accuracy": 0.5, "mismatch/binary_tv_mean": 0.1, "trust_region/masked_frac": 0.1,
              "trust_region/masked_frac_pos": pos, "trust_region/masked_frac_neg": neg}
             for i, (pos, neg) in enumerate(pairs)] for pairs in ([(0.1, 0.05), (0.3, 0.15)], [(0.4, 0.25)] * 2)]
    per_seed = [{**summarize_run(r), "seed": k, "seconds": 1.0, "eval_pass@1": None} for k, r in enumerate(rows)]
    assert [p["masked_pos"] for p in per_seed] == pytest.approx([0.2, 0.4])
    m = {"loss": {}, "summary": summarize_method(per_seed), "per_seed": per_seed, "curves": {}}
    row = method_row(m)
    assert (row["masked_pos"], row["masked_neg"]) == pytest.approx((0.3, 0.175))
    table = report_table(load_study([_write(tmp_path / "a", {"dppo-binary-tv": m, "old": _method([0.5], [0.1] * 8)})]))
    head, _, sign_row, old_row = table.splitlines()
    col = head.split(" | ").index("masked Â>0 / Â<0")
    assert sign_row.split(" | ")[col] == "30.0% / 17.5%"
    assert old_row.split(" | ")[col] == "- / -"  # runs that did not log it (written before it)


def test_paired_difference_hand_computed(tmp_path):
    from dppo.studies.sanity.report import paired_difference

    # seeds 0-2 for the baseline, 1-3 for x: shared seeds 1, 2; differences 0.6 - 0.5 = 0.1 and 0.4 - 0.7 = -0.3
    base = _method([0.2, 0.5, 0.7], [0.1] * 8)
    x = _method([0.6, 0.4, 0.9], [0.1] * 8, first_seed=1)
    study = load_study([_write(tmp_path / "a", {"base": base, "x": x, "one": _method([0.3], [0.1] * 8)})])
    mean, se, n = paired_difference(study, "x", "base")
    assert (mean, n) == (pytest.approx(-0.1), 2)
    assert se == pytest.approx(((0.2 ** 2 + 0.2 ** 2) / 1) ** 0.5 / 2 ** 0.5)  # sd of (0.1, -0.3) is 0.2√2, / √2
    assert paired_difference(study, "one", "base") == (pytest.approx(0.1), None, 1)  # seed 0: 0.3 - 0.2
    table = report_table(study, baseline="base")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    col = rows[0].index("Δ vs base (± SE, seeds)")
    cells = {row[0]: row[col] for row in rows[2:]}
    assert cells == {"base": "-", "x": "-0.100 ± 0.200 (2)", "one": "+0.100 (1)"}
    with pytest.raises(ValueError, match="--baseline 'nope' is not a method"):
        report_table(study, baseline="nope")


def test_more_seeds_from_another_folder_are_pooled(tmp_path):
    a = _write(tmp_path / "a", {"pg-is": _method([0.2, 0.4], [0.1] * 8)})
    b = _write(tmp_path / "b", {"pg-is": _method([0.6], [0.4] * 7 + [1.0], first_seed=2)}, seeds=[2])
    m = load_study([a, b])["methods"]["pg-is"]
    assert [p["seed"] for p in m["per_seed"]] == [0, 1, 2] and m["summary"]["seeds"] == 3
    assert m["summary"]["final_accuracy"] == pytest.approx(0.4)
    curve = m["curves"]["mismatch/binary_tv_mean"]
    assert curve["mean"] == pytest.approx([0.2] * 7 + [0.4])  # (2 x 0.1 + 1 x 0.4) / 3; last (2 x 0.1 + 1.0) / 3
    assert curve["min"][-1] == 0.1 and curve["max"][-1] == 1.0
    row = method_row(m)
    assert (row["min"], row["max"]) == (0.2, 0.6)
    assert "| 0.20 0.40 0.60 |" in report_table(load_study([b, a]))  # seed order, whichever folder comes first


def test_merge_and_control_refusals(tmp_path):
    m = {"pg-is": _method([0.5], [0.1] * 8)}
    a = _write(tmp_path / "a", m)
    with pytest.raises(ValueError, match=r"setting 'lr' is 0.0001.*differ only in the loss"):
        load_study([a, _write(tmp_path / "b", {"cispo": _method([0.5], [0.1] * 8)}, lr=1e-4)])
    with pytest.raises(ValueError, match=r"'pg-is': seeds \[0\] are also in an earlier folder"):
        load_study([a, _write(tmp_path / "d", m)])
    other_loss = {"pg-is": {**_method([0.5], [0.1] * 8, first_seed=1), "loss": {"trust_region": "dppo_binary_tv"}}}
    with pytest.raises(ValueError, match="loss .* differs"):
        load_study([a, _write(tmp_path / "f", other_loss)])
    with pytest.raises(ValueError, match="no such file"):
        load_study([tmp_path / "missing"])
    with pytest.raises(ValueError, match=r"control: setting 'steps' is 9"):
        check_control(load_study([a]), load_study([_write(tmp_path / "e", m, steps=9, engine_lag=0)]))


OLD_SETTINGS = {  # what `dppo sanity` recorded before its settings became SanityConfig (defaults, 8 steps, lag 4)
    "task": "addition", "task_options": {"digits": 1}, "steps": 8, "lr": 3e-4, "prompts_per_step": 32, "group_size": 8,
    "mini_batches": 4, "max_new_tokens": 4, "digits": 1, "size": 80, "eval_size": 20, "hidden": 128, "layers": 2,
    "sft_steps": 60, "warm_seed": 0, "seeds": [0, 1], "engine": "hf", "engine_dtype": "float32", "logit_noise": 0.0,
    "quantization": "none", "engine_lag": 4, "trainer_dtype": "float32", "warm_start": "old/warm-0"}


def test_settings_of_old_and_new_files_are_compared_alike(tmp_path):
    def write(folder, settings, first_seed):
        folder.mkdir(parents=True)
        methods = {"pg-is": _method([0.5], [0.1] * 8, first_seed=first_seed)}
        (folder / "sanity.json").write_text(json.dumps({"settings": settings, "methods": methods, "wall_s": 1.0}))
        return folder

    def new(**fields):
        study = SanityConfig(**{"methods": ("pg-is",), "seeds": (2,), "steps": 8, "engine_dtype": "float32",
                                "engine_lag": 4, "out_dir": str(tmp_path / "new"), **fields})
        return study_settings(study, tmp_path / "new" / "warm-1")

    settings = new()
    assert set(OLD_SETTINGS) < set(settings) and settings["seeds"] == (2,) and settings["lr"] == 3e-4
    old, later = write(tmp_path / "a", OLD_SETTINGS, 0), write(tmp_path / "b", settings, 2)
    study = load_study([old, later])
    assert [p["seed"] for p in study["methods"]["pg-is"]["per_seed"]] == [0, 2]
    check_control(study, load_study([write(tmp_path / "c", new(engine_lag=0), 0)]))  # only the mismatch differs
    with pytest.raises(ValueError, match=r"setting 'lr' is 0.001"):
        load_study([old, write(tmp_path / "d", new(lr=1e-3), 2)])
    with pytest.raises(ValueError, match=r"setting 'task_options' is \{'digits': 2\}"):
        load_study([old, write(tmp_path / "e", new(digits=2), 2)])
    assert load_study([old, write(tmp_path / "f", new(threads=2, mismatch="lag:4"), 2)])["settings"]["steps"] == 8


def test_report_command_on_real_short_studies(tmp_path, capsys):
    kw = dict(seeds=(0, 1), steps=4, prompts_per_step=8, group_size=4, hidden=64, sft_steps=20, eval_size=8,
              engine_dtype="float32")

    def study(methods, folder, **fields):
        return run_sanity(SanityConfig(methods=methods, out_dir=str(tmp_path / folder), **{**kw, **fields}),
                          verbose=False)

    a = study(("pg-is",), "a", engine_lag=2)
    b = study(("dppo-binary-tv",), "b", engine_lag=2)
    study(("pg-is", "dppo-binary-tv"), "c")
    out_json, out_png = tmp_path / "rows.json", tmp_path / "merged.png"
    argv = ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--control", str(tmp_path / "c"), "--parts", "2",
            "--plot", str(out_png), "--json", str(out_json)]
    assert cmd_sanity(argv) == 0
    rows = json.loads(out_json.read_text())["rows"]
    for name, report in (("pg-is", a), ("dppo-binary-tv", b)):
        s = report["methods"][name]["summary"]
        assert rows[name]["final"] == s["final_accuracy"] and rows[name]["collapsed"] == s["collapsed"]
        curve = report["methods"][name]["curves"]["mismatch/binary_tv_mean"]["mean"]
        assert rows[name]["mismatch_parts"] == pytest.approx([sum(curve[:2]) / 2, sum(curve[2:]) / 2])
        assert rows[name]["mismatch_parts"][1] > 0  # the lagged engine differs from the trainer after 2 steps
    assert out_png.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "engine float32 lag 2" in out and "| pg-is |" in out and "| dppo-binary-tv |" in out
    assert "addition, 4 steps, 8 x 4 per step" in out  # single-turn: no environment named
    # a study folder that is not one, and a control with other settings: exit 2 naming the problem
    assert cmd_sanity(["report", str(tmp_path / "nothing")]) == 2
    assert "no such file" in capsys.readouterr().out
    study(("pg-is",), "d", seeds=(0,), steps=3)
    assert cmd_sanity(["report", str(tmp_path / "a"), "--control", str(tmp_path / "d")]) == 2
    assert "setting 'steps'" in capsys.readouterr().out
