"""Kill -9 at four points of a run, resume, and compare with an uninterrupted run: identical weights and metrics.

The points: after the rollout, after the first optimiser step, inside a checkpoint write (before its COMPLETE
marker), and halfway through the append of a metrics.jsonl line (the resume cuts the torn line, with a warning).

Conditions for bitwise equality (stated in the README): CPU, the `hf` engine (its sampling is seeded per step and
per row), the same thread count. The crash is injected with DPPO_FAULT_INJECT (dppo.runtime.faults). The
uninterrupted and the killed runs are processes of their own (one thread); each resume runs in this process (one
thread too, tests/conftest.py), which saves a Python start and dppo's imports per test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ARGS = ["train", "--preset", "smoke", "--train.steps", "5", "--train.checkpoint-every", "1", "--train.keep-checkpoints",
        "10", "--train.no-eval-before", "--log.no-progress", "--log.report-to", "none"]


def _run(args, env_extra=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "DPPO_FAULT_INJECT"}
    env.update({"OMP_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "dppo.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[2])


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    out = _run([*ARGS, "--run-dir", str(run)])
    assert out.returncode == 0, out.stderr[-2000:]
    return run


@pytest.mark.parametrize("point", ["rollout@3", "update@3", "checkpoint@3", "log@3"])
def test_kill9_then_resume_matches_uninterrupted_run(reference, tmp_path, capsys, point):
    from dppo.cli import main

    run = tmp_path / "run"
    crashed = _run([*ARGS, "--run-dir", str(run)], env_extra={"DPPO_FAULT_INJECT": point})
    assert crashed.returncode == -9, (crashed.returncode, crashed.stderr[-2000:])
    steps = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert steps == [1, 2]  # the checkpoint being written when killed (step 3) is not complete
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--log.no-progress"]) == 0
    resumed = capsys.readouterr()
    assert "resumed from" in resumed.out and "step_000002" in resumed.out
    torn = f"[dppo] warning: {run / 'metrics.jsonl'}: dropped "
    assert (torn in resumed.err) == (point == "log@3"), resumed.err[-2000:]
    assert not list((run / "checkpoints").glob(".tmp_*"))
    a = load_file(str(reference / "checkpoints" / "step_000005" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_000005" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(run) == _metrics(reference)
