"""scripts/compact_sanity.py: the thinned copy keeps every summary and the kept curve points exactly, and a report
rebuilt from a study's run folders equals the one `dppo sanity` wrote (seconds and wall time taken from it)."""

import importlib.util
import json
from pathlib import Path

import pytest

from dppo.studies.sanity import SanityConfig, run_sanity

_SPEC = importlib.util.spec_from_file_location(
    "compact_sanity", Path(__file__).resolve().parents[1] / "scripts" / "compact_sanity.py")
compact_sanity = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compact_sanity)

FLAGS = "--methods pg-is,dppo-binary-tv --seeds 0,1 --steps 4 --prompts-per-step 8 --group-size 4 --hidden 64 " \
        "--sft-steps 20 --eval-size 8 --mismatch lag:2"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    cfg = SanityConfig(methods=("pg-is", "dppo-binary-tv"), seeds=(0, 1), steps=4, prompts_per_step=8, group_size=4,
                       hidden=64, sft_steps=20, eval_size=8, mismatch="lag:2", out_dir=str(out))
    return out, json.loads(json.dumps(run_sanity(cfg, verbose=False)))  # as read back from sanity.json


def test_rebuilt_report_equals_the_written_one(study):
    out, written = study
    rebuilt = json.loads(json.dumps(compact_sanity.rebuild(out, FLAGS)))  # as written to disk
    assert rebuilt["wall_s"] == written["wall_s"] > 0
    assert rebuilt["settings"] == written["settings"]
    assert list(rebuilt["methods"]) == list(written["methods"]) == ["pg-is", "dppo-binary-tv"]
    for name, m in written["methods"].items():
        r = rebuilt["methods"][name]
        assert r["summary"] == m["summary"]  # the same rows, the same arithmetic
        assert r["per_seed"] == m["per_seed"]
        assert r["curves"] == m["curves"] and r["loss"] == m["loss"]


def test_rebuild_leaves_out_unfinished_seeds(study, tmp_path):
    out, written = study
    part = tmp_path / "part"
    for run in ("pg-is-seed0", "pg-is-seed1"):
        (part / run).mkdir(parents=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            (part / run / name).write_text((out / run / name).read_text())
    lines = (part / "pg-is-seed1" / "metrics.jsonl").read_text().splitlines()
    (part / "pg-is-seed1" / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # stopped before its last step
    rebuilt = compact_sanity.rebuild(part, FLAGS)
    assert list(rebuilt["methods"]) == ["pg-is"] and [p["seed"] for p in rebuilt["methods"]["pg-is"]["per_seed"]] == [0]
    assert rebuilt["methods"]["pg-is"]["per_seed"][0]["seconds"] is None  # no sanity.json to take it from
    assert rebuilt["methods"]["pg-is"]["per_seed"][0]["final_accuracy"] == \
        written["methods"]["pg-is"]["per_seed"][0]["final_accuracy"]


def test_compact_keeps_every_nth_point_and_the_first(study):
    _, written = study
    small = compact_sanity.compact(written, every=2)
    for name, m in written["methods"].items():
        assert small["methods"][name]["summary"] == m["summary"]
        for key, c in m["curves"].items():
            kept = small["methods"][name]["curves"][key]
            assert kept["step"] == [s for i, s in enumerate(c["step"]) if i == 0 or s % 2 == 0]
            idx = [c["step"].index(s) for s in kept["step"]]
            assert kept["mean"] == pytest.approx([c["mean"][i] for i in idx], rel=1e-4)
