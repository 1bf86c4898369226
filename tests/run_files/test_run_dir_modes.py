"""The run directory's faults (a full disk, a kill inside a checkpoint write) in the two other ways a run trains:
asynchronous rollout workers (`rollout.mode async`) and torchrun ranks. Each time the faulted run stops with the
one-line RunDirError (or is killed), nothing is left running (no rollout worker, no rank), and `--resume` once
the space is back ends as an uninterrupted run of the same kind: the same per-step rewards and final weights,
each step logged once.

The full disk is injected as in tests/run_files/test_run_dir.py, at the writer's own write calls (`run_dir._write` for the
JSONL appends, `run_dir._open` for every other file): in process through `dppo.cli.main` for async runs (the
rollout workers write nothing to the run directory), and in rank 0 of a torchrun job by this file's `__main__`
(the per-rank entry point), since only rank 0 writes the run directory. Every run uses the hf engine in float32
and one thread per process, the conditions under which a run is bitwise reproducible (docs/cli.md).

This file is also the per-rank entry point of the torchrun test (`python tests/run_files/test_run_dir_modes.py ...`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import dppo.run_files.run_dir as run_dir_mod
from dppo.cli import main
from dppo.run_files.checkpoint import load_checkpoint
from dppo.run_files.run_dir import complete_checkpoints
from conftest import launch_ranks as _launch, torchrun as _torchrun

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
QUIET = ["--train.no-eval-before", "--log.no-progress", "--log.report-to", "none", "--no-hf"]
ARGS = ["--preset", "smoke", "--train.steps", str(STEPS), "--train.checkpoint-every", "1",
        "--train.keep-checkpoints", "10", "--train.threads", "1", *QUIET]
ASYNC = [*ARGS, "--rollout.mode", "async", "--rollout.engine", "hf", "--rollout.dtype", "float32",
         "--rollout.worker-threads", "1", "--rollout.worker-timeout-s", "60"]
ONE_LINE = (r"^dppo train: error: {run}/\S*{site}: no space left on device \(ENOSPC\) while writing; [\d.]+ "
            r"(B|KiB|MiB|GiB) free under {run}; newest complete checkpoint: {run}/checkpoints/step_000002 \(intact\); "
            r"free space, then resume with: dppo train --resume {run}$")


def _enospc():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _rollout_workers(pid: int) -> list[psutil.Process]:
    """The spawned rollout worker processes under `pid` (multiprocessing's spawn entry point)."""
    return [c for c in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]


def _alive(procs: list[psutil.Process], wait_s: float = 10) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        left = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return []
        time.sleep(0.1)
    return left


class Fault:
    """ENOSPC at one write site (a JSONL log, or a file the writer opens), from its `at`-th write on, while
    armed; `workers`: the rollout workers alive when the fault fired (they must not outlive the run)."""

    def __init__(self, site: str, at: int, patch=None) -> None:
        self.site, self.at, self.seen, self.armed, self.workers = site, at, 0, True, []
        real_write, real_open = run_dir_mod._write, run_dir_mod._open
        patch = patch or (lambda name, fn: setattr(run_dir_mod, name, fn))

        def fire():
            self.seen += 1
            if self.seen >= self.at:
                self.workers = self.workers or _rollout_workers(os.getpid())
                return True
            return False

        if site.endswith(".jsonl"):
            def write(fd, data):
                if self.armed and os.readlink(f"/proc/self/fd/{fd}").endswith(site) and fire():
                    real_write(fd, data[: len(data) // 3])  # a short write, then the disk is full
                    _enospc()
                return real_write(fd, data)

            patch("_write", write)
        else:
            def opener(path, mode="r", *args, **kwargs):
                if self.armed and Path(path).name == site and "w" in mode and fire():
                    _enospc()
                return real_open(path, mode, *args, **kwargs)

            patch("_open", opener)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _prompts(run: Path) -> list[tuple[int, str]]:
    """(step, prompt) of every sample the run logged."""
    return [(s["step"], s["prompt"]) for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines())]


def _assert_same_weights(reference: Path, run: Path) -> None:
    a = load_file(str(reference / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_like_the_reference(run: Path, reference: Path) -> None:
    """Each step logged once, the reference's per-step rewards (exactly) and final weights (bitwise)."""
    assert [r["step"] for r in _rows(run)] == list(range(1, STEPS + 1))
    assert [r["reward/mean"] for r in _rows(run)] == [r["reward/mean"] for r in _rows(reference)]
    _assert_same_weights(reference, run)


# ---------------------------------------------------------------------------------------------- async workers
@pytest.fixture(scope="module")
def async_reference(tmp_path_factory) -> Path:
    """An uninterrupted async run with max_staleness 0: every batch is sampled by the weights that train on it,
    so the run is deterministic (it equals the sync run, tests/rollout/test_async_source.py)."""
    run = tmp_path_factory.mktemp("async_reference") / "run"
    assert main(["train", *ASYNC, "--rollout.max-staleness", "0", "--run-dir", str(run)]) == 0
    return run


def _train_async_with_fault(monkeypatch, capsys, run: Path, site: str, k: int) -> tuple[str, Fault]:
    fault = Fault(site, 3, patch=lambda name, fn: monkeypatch.setattr(run_dir_mod, name, fn))
    capsys.readouterr()
    assert main(["train", *ASYNC, "--rollout.max-staleness", str(k), "--run-dir", str(run)]) == 1
    fault.armed = False
    return capsys.readouterr().err, fault


def _assert_stopped_cleanly(err: str, fault: Fault, run: Path, site: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(ONE_LINE.format(run=re.escape(str(run)), site=re.escape(site)), err.strip()), err
    assert fault.workers, "the fault fired with no rollout worker running"
    assert not _alive(fault.workers), "a rollout worker outlived the stopped run"
    for folder in complete_checkpoints(run):  # every checkpoint marked complete still loads
        load_checkpoint(folder)
    assert [p.name for p in complete_checkpoints(run)] == ["step_000001", "step_000002"]


@pytest.mark.parametrize("site", ["metrics.jsonl", pytest.param("optimizer.pt", marks=pytest.mark.slow)])
def test_async_full_disk_stops_workers_and_resume_matches_an_uninterrupted_run(async_reference, tmp_path,
                                                                               monkeypatch, capsys, site):
    run = tmp_path / "run"
    err, fault = _train_async_with_fault(monkeypatch, capsys, run, site, k=0)
    _assert_stopped_cleanly(err, fault, run, site)
    assert main(["train", "--resume", str(run), "--log.no-progress", "--no-hf"]) == 0
    _assert_like_the_reference(run, async_reference)


def test_async_full_disk_with_staleness_1_resumes_the_same_steps_and_prompts(async_reference, tmp_path,
                                                                             monkeypatch, capsys):
    """With max_staleness 1 a batch is sampled by the weights of its step or of the step before, whichever the
    worker had loaded when it started the request: a matter of timing (and a resumed run's first batch is sampled
    from the restored weights, where the uninterrupted run may have used older ones). Rewards and weights then
    depend on timing and are not compared. What does not: the steps (each logged once), the prompts of each step
    (the checkpoint keeps the position after the last trained batch, so batches in flight are drawn again from
    the same place; the k=0 reference draws the same prompts), the staleness bound, and the checkpoints written
    before the fault, which the resumed run starts from unchanged."""
    run = tmp_path / "run"
    err, fault = _train_async_with_fault(monkeypatch, capsys, run, "metrics.jsonl", k=1)
    _assert_stopped_cleanly(err, fault, run, "metrics.jsonl")
    before = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--log.no-progress", "--no-hf"]) == 0
    assert "resumed from" in capsys.readouterr().out
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert _prompts(run) == _prompts(async_reference)
    after = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _dppo(args: list[str], env_extra: dict | None = None, timeout: float = 240) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DPPO_FAULT_INJECT"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})})
    return subprocess.Popen([sys.executable, "-m", "dppo.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_async_kill_during_a_checkpoint_write_then_resume_matches_an_uninterrupted_run(async_reference, tmp_path):
    """SIGKILL inside checkpoint 3's write (after its weights, before its marker): the kernel ends the workers
    (PR_SET_PDEATHSIG), step 3's checkpoint is not complete, and the resume (in process, one thread, as the
    reference) ends bitwise as the uninterrupted run."""
    run = tmp_path / "run"
    proc = _dppo(["train", *ASYNC, "--rollout.max-staleness", "0", "--run-dir", str(run)],
                 {"DPPO_FAULT_INJECT": "checkpoint@3"})
    try:
        deadline, workers = time.monotonic() + 90, []
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            workers = _rollout_workers(proc.pid)
            time.sleep(0.1)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert workers and not _alive(workers), "a rollout worker outlived the killed trainer"
    assert [p.name for p in complete_checkpoints(run)] == ["step_000001", "step_000002"]
    assert main(["train", "--resume", str(run), "--log.no-progress", "--no-hf"]) == 0
    assert not list((run / "checkpoints").glob(".tmp_*"))
    _assert_like_the_reference(run, async_reference)


# ---------------------------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("torchrun_reference") / "run"
    done = _torchrun(["-m", "dppo.cli", "train", *ARGS, "--run-dir", str(run)])
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("site", ["metrics.jsonl", "optimizer.pt"])
def test_torchrun_full_disk_on_rank_0_stops_every_rank_and_resume_matches(torchrun_reference, tmp_path, site):
    """ENOSPC at rank 0's write of `site` in step 3: rank 0 prints the one line and exits 1; rank 1 exits
    non-zero well within train.dist_timeout_s (the launcher's timeout bounds the test, so a hang fails it), and
    torchrun --resume then ends as the uninterrupted torchrun run; after the second, one process resumes the
    2-process FSDP2 run for one more step (any world size resumes a checkpoint; this was
    tests/train/test_distributed.py's `test_torchrun_train_then_resume_at_any_world_size`, two more torchrun launches).

    Rank 1 says why at either site: a checkpoint is written by rank 0 inside a collective agreement
    (`save_training_checkpoint`), and a step's log line is followed by one (`Trainer.train`), so rank 1 raises the
    DistributedError naming rank 0's RunDirError (one line)."""
    run = tmp_path / "run"
    args = [str(Path(__file__)), "enospc", site, "3", "train", *ARGS, "--run-dir", str(run),
            "--train.dist-timeout-s", "30"]
    (rc0, err0, t0), (rc1, err1, t1) = _launch([args, args], timeout=150)
    assert rc0 == 1, err0[-3000:]
    line = err0.strip().splitlines()[-1]
    assert re.search(ONE_LINE.format(run=re.escape(str(run)), site=re.escape(site)), line), err0[-3000:]
    assert "Traceback" not in err0, err0[-3000:]
    assert rc1 not in (0, -signal.SIGKILL), err1[-3000:]
    assert t1 - t0 < 20, (t0, t1)  # not the 30 s collective timeout: rank 1 notices at once
    named = (rf"^dppo train: error: rank 0 of 2 failed: RunDirError: {re.escape(str(run))}/\S*{re.escape(site)}: "
             r"no space left on device")
    assert rc1 == 2 and re.search(named, err1.strip(), re.M), err1[-3000:]
    assert [p.name for p in complete_checkpoints(run)] == ["step_000001", "step_000002"]
    resumed = _torchrun(["-m", "dppo.cli", "train", "--resume", str(run), "--log.no-progress", "--no-hf"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resumed from") == 1 and "step_000002" in resumed.stdout
    _assert_like_the_reference(run, torchrun_reference)
    if site == "optimizer.pt":  # a checkpoint is full (rank 0 gathers FSDP2's shards): one process goes on from it
        assert main(["train", "--resume", str(run), "--train.steps", str(STEPS + 1), "--log.no-progress", "--no-hf"]) == 0
        assert [r["step"] for r in _rows(run)] == list(range(1, STEPS + 2))


if __name__ == "__main__":  # one rank of the torchrun test: ENOSPC at SITE from its AT-th write on rank 0
    _, site, at, *argv = sys.argv[1:]
    if os.environ.get("RANK", "0") == "0":
        Fault(site, int(at))
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
