"""The collapse warning: each monitor against a hand computation on a constructed series, the study's labels, fit and
held-out figures on constructed runs whose answer is known, the corpus file round trip, and the online watch in the
logger (a resumed run reads its earlier steps back)."""

from __future__ import annotations

import gzip
import json

import pytest

from dppo import collapse_warning as cw
from dppo.run_files.collapse_watch import CollapseWatch
from dppo.run_files.logger import RunLogger
from dppo.studies.sanity import warning as study


def rows_of(key: str, values) -> list[dict]:
    return [{"step": i + 1, key: v} for i, v in enumerate(values)]


def test_rise_level_drop_drift_by_hand():
    xs = [1.0, 1.0, 2.0, 1.0, 1.0] + [3.0] * 5 + [6.0] * 5  # baseline mean 1.2
    r = cw.rise(xs)
    assert r[:5] == [None] * 5  # the first score is at step BASELINE + 1 (index 5)
    assert r[5] == pytest.approx((1 + 2 + 1 + 1 + 3) / 5 / 1.2)  # (until index 9 the window overlaps the baseline)
    assert r[9] == pytest.approx(3.0 / 1.2) and r[14] == pytest.approx(6.0 / 1.2)
    assert r[11] == pytest.approx((3 * 3 + 2 * 6) / 5 / 1.2)
    assert cw.level(xs)[14] == pytest.approx(6.0)
    assert cw.drop(xs)[9] == pytest.approx(1 - 3.0 / 1.2)
    assert cw.drift(xs)[9] == pytest.approx(abs(3.0 - 1.2) / 1.2)


def test_acceleration_by_hand_and_missing_values():
    xs = [1.0] * 10 + [2.0] * 5 + [5.0] * 5  # m_t = 5, m_{t-5} = 2, m_{t-10} = 1 at the last step
    a = cw.acceleration(xs)
    assert a[-1] == pytest.approx((5 - 2 * 2 + 1) / 1.0) and a[14] is None
    assert a[15] == pytest.approx(13 / 5 - 2 * 6 / 5 + 1)  # first score at index BASELINE + 2W = 15: m = 2.6, 1.2, 1
    assert cw.acceleration([1.0] * 15) == [None] * 15
    s = cw.series([{"a": 1.0, "b": 2.0}, {"a": 1.0}, {"a": float("nan"), "b": 1.0}], "a", "b")
    assert s == [3.0, None, None]
    assert cw.rise([None] * 12) == [None] * 12


def test_every_monitor_reads_a_logged_key_and_first_fire():
    rows = [{"mismatch/binary_tv_mean": 0.01 * (1 + (i > 20) * 9), "ledger/bound_sum": 0.1, "ledger/tv_max": 0.2,
             "ledger/drift_net": 0.1, "ledger/masked_mass_mismatch_pos": 0.01, "ledger/masked_mass_mismatch_neg": 0.02,
             "ledger/drift_staleness_share": 0.5, "mismatch/binary_kl_mean": 0.001, "policy/entropy": 1.0,
             "ledger/adv_std": 0.3} for i in range(40)]
    for name in cw.MONITORS:
        assert any(s is not None for s in cw.scores(rows, name)), name
    tv = cw.scores(rows, "tv_rise")
    assert cw.first_fire(tv, 5.0) == 23  # rows 21.. are 10x: the 5-step mean passes 5x at the 3rd of them
    assert cw.first_fire(tv, 11.0) is None
    assert cw.scores(rows, "mask_on_mismatch")[-1] == pytest.approx(0.03)
    with pytest.raises(ValueError, match="unknown 'nope'"):
        cw.scores(rows, "nope")


def run(seed: int, *, collapse_at: int | None, rise_at: int | None, steps: int = 80, method: str = "m") -> dict:
    """Accuracy 0.9, falling to 0.1 from `collapse_at`; the TV 0.01, 10x from `rise_at`."""
    rows = []
    for t in range(steps):
        acc = 0.1 if collapse_at is not None and t >= collapse_at else 0.9
        tv = 0.1 if rise_at is not None and t >= rise_at else 0.01
        rows.append({"step": t + 1, "reward/accuracy": acc, "advantage/zero_group_frac": 0.0,
                     "mismatch/binary_tv_mean": tv, "policy/entropy": 1.0})
    return {"group": "g", "method": method, "seed": seed, "rows": rows}


def test_onset_is_where_the_running_mean_has_lost_a_quarter():
    r = run(0, collapse_at=40, rise_at=None)["rows"]
    # peak 0.9, final 0.1: the line is 0.5; the 5-step mean is 0.9 - 0.8 k / 5 with k steps at 0.1: k = 3 at index 42
    assert study.collapse_onset(r) == 42
    assert study.collapse_onset(run(0, collapse_at=None, rise_at=None)["rows"]) is None


def test_fit_and_held_out_on_a_monitor_that_foresees_every_collapse():
    """The TV rises 10 steps before each collapse, and never in a stable run: recall 1, a lead of about 10 steps, no
    false alarm; a monitor that never moves (entropy) warns of nothing."""
    runs = [run(s, collapse_at=50 + s, rise_at=40 + s, method="bad") for s in range(1, 5)]
    runs += [run(s, collapse_at=None, rise_at=None, method="good") for s in range(1, 5)]
    res = study.study(runs, fit_seeds=[1, 2])
    assert res["runs"] == {"fit": {"runs": 4, "collapsed": 2}, "held_out": {"runs": 4, "collapsed": 2}}
    h = res["held_out"]["tv_rise"]
    assert h["recall"] == 1.0 and h["false_alarm_rate"] == 0.0 and h["late"] == 0
    fire = cw.first_fire(cw.scores(runs[2]["rows"], "tv_rise"), res["fit"]["tv_rise"]["threshold"])
    assert h["lead_median"] == study.collapse_onset(runs[2]["rows"]) - fire and 0 < h["lead_median"] <= 12
    assert res["rule"] == "tv_rise"
    assert res["held_out"]["entropy_drop"]["recall"] == 0.0
    assert "| tv_rise | ledger (the rule) |" in study.table(res)


def test_late_warnings_and_false_alarms_are_counted():
    runs = [run(1, collapse_at=30, rise_at=60), run(2, collapse_at=None, rise_at=20)]
    lab = study.labelled(runs, ["tv_rise"])
    e = study.evaluate(lab, "tv_rise", 5.0)
    assert (e["warned"], e["late"], e["false_alarms"], e["recall"], e["false_alarm_rate"]) == (0, 1, 1, 0.0, 1.0)


def test_the_corpus_round_trip_and_a_bad_line(tmp_path):
    runs = [run(1, collapse_at=30, rise_at=20), run(2, collapse_at=None, rise_at=None)]
    path = tmp_path / "corpus.jsonl.gz"
    study.save_corpus(runs, path)
    assert study.load([str(path)]) == runs
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write(gzip.decompress(path.read_bytes()).decode().splitlines()[0] + "\n{\"group\": 1}\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: line 2: not a corpus run"):
        study.load([str(bad)])
    assert study.main([str(tmp_path / "missing")]) == 2


def test_the_command_on_out_dirs(tmp_path, capsys):
    out = tmp_path / "lag4-a"
    for r in [run(s, collapse_at=50 + s, rise_at=40 + s, method="bad") for s in (1, 2)] + \
             [run(s, collapse_at=None, rise_at=None, method="good") for s in (1, 2)]:
        d = out / f"{r['method']}-seed{r['seed']}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in r["rows"]) + "\n")
    assert study.main([str(out), "--fit-seeds", "1", "--json", str(tmp_path / "w.json"),
                       "--corpus", str(tmp_path / "c.jsonl.gz")]) == 0
    text = capsys.readouterr().out
    assert "4 runs: fit seeds 1 (2 runs, 1 collapsed)" in text
    assert json.loads(text.strip().splitlines()[-1])["tv_rise_recall"] == 1.0
    assert [r["group"] for r in study.load([str(tmp_path / "c.jsonl.gz")])] == ["lag4"] * 4


def test_the_watch_fires_once_and_keeps_only_what_it_reads():
    watch = CollapseWatch(("tv_rise", 5.0))
    lines = []
    for step, r in enumerate(run(1, collapse_at=None, rise_at=30, steps=200)["rows"], 1):
        out, line = watch.update(step, r)
        lines += [(step, line)] if line else []
        assert len(watch.rows) <= cw.BASELINE + 3 * cw.WINDOW
        if step >= cw.BASELINE + cw.WINDOW:
            want = cw.scores(run(1, collapse_at=None, rise_at=30, steps=step)["rows"], "tv_rise")[-1]
            assert out["warning/collapse_score"] == pytest.approx(want)
    assert [s for s, _ in lines] == [33] and "is 6.4x its first steps' (threshold 5x)" in lines[0][1]
    silent = CollapseWatch(("drift_rise", 2.0))
    said = [silent.update(s, {"reward/accuracy": 1.0})[1] for s in range(1, 30)]
    assert sum(x is not None for x in said) == 1 and "has no value" in said[cw.BASELINE]


def test_the_logger_writes_the_warning_and_a_resumed_run_remembers(tmp_path, capsys):
    """Whatever RULE is: every key a monitor reads rises 10x from step 31."""
    keys = ["mismatch/binary_tv_mean", "ledger/bound_sum", "ledger/tv_max", "ledger/drift_net", *cw.MASK_MISMATCH,
            "ledger/drift_staleness_share", "mismatch/binary_kl_mean", "ledger/adv_std"]
    rows = [{"step": t + 1, "policy/entropy": 1.0 / (1 + 9 * (t >= 30)), **{k: 0.01 * (1 + 9 * (t >= 30)) for k in keys}}
            for t in range(60)]
    fire = cw.first_fire(cw.scores(rows, cw.RULE[0]), cw.RULE[1])
    assert fire is not None and fire >= 30
    log = RunLogger(tmp_path, total_steps=60, report_to=(), progress=False, collapse_warning=True)
    for r in rows[:25]:
        log.log_step(r["step"], {k: v for k, v in r.items() if k != "step"})
    log.close()
    log = RunLogger(tmp_path, total_steps=60, report_to=(), progress=False, collapse_warning=True, start_step=25)
    for r in rows[25:]:
        log.log_step(r["step"], {k: v for k, v in r.items() if k != "step"})
    log.close()
    written = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(i for i, w in enumerate(written) if "warning/collapse" in w)
    assert first == cw.BASELINE  # steps 1..5 are the baseline (docs/cli.md); from step 6 every step has both keys
    assert all("warning/collapse_score" in w for w in written[first:])
    assert [w["warning/collapse"] for w in written[first:]] == [float(i >= fire) for i in range(first, 60)]
    assert written[-1]["warning/collapse_score"] == pytest.approx(cw.scores(rows, cw.RULE[0])[-1])
    out = capsys.readouterr().out
    assert out.count("collapse warning") == 1 and f"step {fire + 1}: collapse warning" in out


def test_the_rule_is_the_one_the_committed_study_chose():
    from pathlib import Path

    result = json.loads((Path(__file__).resolve().parents[1] / "docs/data/warning/warning.json").read_text())
    assert cw.RULE == (result["rule"], result["fit"][result["rule"]]["threshold"])
    assert cw.MONITORS[cw.RULE[0]][0] == "ledger"


def test_the_committed_corpus_gives_the_committed_result():
    """docs/paper.md's table is `dppo sanity warning docs/data/warning/corpus.jsonl.gz --fit-seeds 1,3`."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "docs/data/warning"
    runs = study.load([str(data / "corpus.jsonl.gz")])
    assert len(runs) >= 60 and len({(r["group"], r["method"], r["seed"]) for r in runs}) == len(runs)
    assert json.loads(json.dumps(study.study(runs, [1, 3]))) == json.loads((data / "warning.json").read_text())
