"""`dppo doctor` on constructed runs where the answer is known: rows written as a run writes them (the ledger's keys),
one dominant source at a time, a source that took over mid-run, a run without the drift split, a running run's
torn last line; and real runs of the tiny model where one source is the only one: a bf16 engine beside an fp32
trainer with a negligible learning rate (precision), an fp32 engine 2 steps stale (staleness), an fp32 engine and a
too-high learning rate (learning)."""

from __future__ import annotations

import json

import pytest

from dppo.run_files import doctor


def row(step: int, precision: float, staleness: float, learning: float, *, masked=0.1, on_mismatch=0.5,
        entropy=1.0) -> dict:
    m = masked * on_mismatch
    return {"step": step, "loss/policy": 0.0, "reward/mean": 0.5, "policy/entropy": entropy,
            "ledger/drift_precision": precision, "ledger/drift_staleness": staleness,
            "ledger/drift_learning": learning, "ledger/masked_mass": masked,
            "ledger/masked_mass_mismatch_pos": m / 2, "ledger/masked_mass_mismatch_neg": m / 2,
            "ledger/masked_mass_update_pos": (masked - m) / 2, "ledger/masked_mass_update_neg": (masked - m) / 2,
            "trust_region/masked_frac": masked / 2}


BF16 = {"rollout": {"engine": "vllm", "dtype": "bfloat16", "engine_lag": 0}, "model": {"precision": "fp32"},
        "optim": {"lr": 1e-5}}


@pytest.mark.parametrize("source, parts, config, advice", [
    ("precision", (0.02, 0.0, 0.002), BF16, "--rollout.dtype float32"),
    ("staleness", (1e-6, 0.05, 0.01), {"rollout": {"dtype": "float32", "engine_lag": 4}, "model": {"precision": "fp32"}},
     "(rollout.engine-lag): lower it"),
    ("learning", (1e-6, 0.0, 0.08), {"rollout": {"dtype": "float32"}, "model": {"precision": "fp32"},
                                     "optim": {"lr": 1e-4}}, "optim.lr 0.0001 -> 5e-05"),
])
def test_the_dominant_source_and_its_advice(source, parts, config, advice):
    rows = [row(s, *parts, masked=0.2, on_mismatch=0.8 if source != "learning" else 0.1) for s in range(1, 21)]
    report = doctor.diagnose(rows, config)
    assert report.dominant == source and report.since == 1
    assert report.shares[source] > 0.5 and sum(report.shares.values()) == pytest.approx(1.0)
    assert any(advice in a for a in report.advice), report.advice
    if source == "learning":
        assert "mostly on learning" in report.text()
    else:
        assert "mostly on the mismatch" in report.text()


def test_since_when_a_source_took_over():
    """Learning led steps 1-10, then the staleness grew past it (a lagged engine whose policy moved faster)."""
    rows = [row(s, 0.0, 0.01 * s, 0.105) for s in range(1, 31)]  # staleness passes learning at step 11
    report = doctor.diagnose(rows, {"rollout": {"engine_lag": 2}})
    assert report.dominant == "staleness" and report.since == 11
    assert "since step 11" in report.text()


def test_a_run_without_the_split_says_how_to_get_it():
    rows = [{"step": s, "loss/policy": 0.0, "ledger/masked_mass": 0.01} for s in range(1, 4)]
    report = doctor.diagnose(rows, {})
    assert report.dominant is None and "--loss.split-mismatch" in report.text()
    assert report.mask_on_mismatch is None and "masks little" in report.text()


def test_the_staleness_the_steps_saw_is_what_the_advice_names():
    rows = [row(s, 0.0, 0.05, 0.01) | {"rollout/staleness_max": 3.0 + (s == 12)} for s in range(1, 21)]
    assert any("up to 4 step(s) stale (rollout.engine-lag or rollout.max-staleness)" in a
               for a in doctor.diagnose(rows, {}).advice)
    assert any("up to 4 step(s) stale (rollout.engine-lag)" in a
               for a in doctor.diagnose(rows, {"rollout": {"engine_lag": 8}}).advice)


def test_the_entropy_collapse_is_named():
    rows = [row(s, 0.0, 0.0, 0.05, entropy=1.0 / s) for s in range(1, 11)]
    assert "entropy halved" in doctor.diagnose(rows, {}).text()


def test_the_collapse_warning_is_named_with_its_step():
    rows = [row(s, 0.0, 0.01, 0.01) | ({"warning/collapse": float(s >= 7), "warning/collapse_score": 0.5 * s}
                                       if s >= 3 else {}) for s in range(1, 11)]
    report = doctor.diagnose(rows, {})
    assert report.warned_at == 7 and "collapse warning fired at step 7 (score 3.5)" in report.text()
    assert doctor.diagnose(rows[:6], {}).warned_at is None


def test_reads_a_running_run_and_draws_the_ledger(tmp_path, capsys):
    lines = [json.dumps(row(s, 0.01, 0.0, 0.001)) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "loss/pol')  # torn: being written
    (tmp_path / "config.yaml").write_text("rollout:\n  dtype: bfloat16\nmodel:\n  precision: fp32\n")
    report = doctor.main(str(tmp_path))
    assert report.steps == 5 and report.dominant == "precision"
    assert (tmp_path / "doctor.png").stat().st_size > 1000
    assert "picture:" in capsys.readouterr().out


def test_a_damaged_line_inside_the_log_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n' + json.dumps(row(2, 0.1, 0, 0)) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 1: not valid JSON"):
        doctor.read_rows(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        doctor.read_rows(tmp_path / "missing")


@pytest.mark.parametrize("source, sections, advice", [
    ("precision", {"rollout": {"dtype": "bfloat16"}, "optim": {"lr": 1e-7}}, "--rollout.dtype float32"),
    ("staleness", {"rollout": {"engine_lag": 2}, "optim": {"lr": 1e-3}}, "up to 2 step(s) stale"),
    ("learning", {"optim": {"lr": 3e-2}}, "a smaller learning rate (optim.lr 0.03 -> 0.015)"),
])
def test_the_doctor_names_the_source_of_real_runs(tmp_path, source, sections, advice):
    from conftest import smoke_config

    from dppo.cli import main
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, loss={"split_mismatch": True}, train={"steps": 6, "threads": 1}, **sections)
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.train()
    finally:
        trainer.close()
    trainer.cfg.save(tmp_path / "config.yaml")  # (as `dppo train` writes it)
    report = doctor.diagnose(doctor.read_rows(tmp_path), yaml_config(tmp_path))
    assert report.dominant == source and report.shares[source] > 0.75, report.text()
    assert any(advice in a for a in report.advice), report.advice
    assert main(["doctor", str(tmp_path), "--no-picture"]) == 0


def yaml_config(run_dir) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_doctor_on_a_missing_run_is_one_line(tmp_path, capsys):
    from dppo.cli import main

    assert main(["doctor", str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
