"""The run directory under the faults of long jobs: a full disk at each file a run writes, torn log lines, and
errors that name their cause (`dppo.run_files.run_dir`, the logger's resume repair, `dppo.cli.main`'s error policy).

Faults are injected at the writer's own write calls (`run_dir._write` for the JSONL appends, `run_dir._open` for
every other file the writer opens, safetensors' `save_file`, a tracker's `log`), and on a real small tmpfs where
this machine lets the test mount one (root; skipped with the reason otherwise). The end-to-end tests run the
smoke preset in process through `dppo.cli.main`: the faulted run stops with one line, every complete checkpoint
still loads, and `--resume` once the space is back gives the final weights and per-step rewards of an
uninterrupted run, each step logged once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dppo.run_files.run_dir as run_dir_mod
from dppo.cli import main
from dppo.run_files.checkpoint import load_checkpoint, save_checkpoint
from dppo.run_files.logger import RunLogger
from dppo.run_files.run_dir import MARKER, JsonlWriter, RunDirError, complete_checkpoints, disk_errno, repair_jsonl

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
ARGS = ["--preset", "smoke", "--train.steps", "4", "--train.checkpoint-every", "1", "--train.keep-checkpoints", "10",
        "--train.no-eval-before", "--log.no-progress", "--log.report-to", "none", "--no-hf"]
ONE_LINE = (r"no space left on device \(ENOSPC\) while writing.*; [\d.]+ (B|KiB|MiB|GiB) free under {run}; "
            r"newest complete checkpoint: {run}/checkpoints/step_000002 \(intact\); free space, then resume with: "
            r"dppo train --resume {run}")


def _enospc(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------------------------------------- the writer
def test_a_failed_append_leaves_no_half_line(tmp_path, monkeypatch):
    writer = JsonlWriter(tmp_path, tmp_path / "metrics.jsonl")
    writer.write({"step": 1, "reward/mean": 0.5})

    def half_then_full(fd, data):  # what a full disk does: a short write, then ENOSPC
        if len(data) > 20:
            return os.write(fd, data[: len(data) // 2])
        _enospc()

    monkeypatch.setattr(run_dir_mod, "_write", half_then_full)
    with pytest.raises(RunDirError, match=r"metrics\.jsonl: no space left on device \(ENOSPC\) while writing; .* free "
                                          r"under .*; no complete checkpoint yet; free space, then start the run "
                                          r"again"):
        writer.write({"step": 2, "reward/mean": 0.25, "text": "x" * 100})
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
    (OSError(errno.EIO, "Input/output error"), errno.EIO),
    (OSError(errno.EROFS, "Read-only file system"), errno.EROFS),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (OSError(errno.ENOENT, "No such file or directory"), None),
    (ValueError("shape mismatch"), None),
])
def test_disk_errors_are_told_from_other_errors(tmp_path, exc, code):
    assert disk_errno(exc, tmp_path) == code


def test_torch_save_unexpected_pos_is_reported_as_the_full_disk(tmp_path, monkeypatch):
    """torch.save turns the OSError of its writer into `RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos`; the writer's file object keeps the OSError, so the error says what happened."""
    real_open = open

    class Full:
        def __init__(self, path, mode):
            self._f, self.n = real_open(path, mode), 0

        def write(self, data):
            self.n += len(data)
            if self.n > 300:
                _enospc()
            return self._f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(run_dir_mod, "_open", Full)
    with pytest.raises(RunDirError, match=r"optimizer\.pt: no space left on device \(ENOSPC\)") as info:
        run_dir_mod.save_torch(tmp_path, {"state": torch.zeros(10_000)}, tmp_path / "optimizer.pt")
    assert "unexpected pos" in str(info.value.__cause__.__cause__)  # what torch itself raised


# ------------------------------------------------------------------------------------------------- checkpoints
def _save(run: Path, step: int, model: torch.nn.Module, optimizer) -> Path:
    return save_checkpoint(run, step, weights=dict(model.named_parameters()), optimizer=optimizer,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                           trainer_state={"sampler_position": step}, keep=10)


@pytest.fixture
def model_and_optimizer():
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fail_opening(name: str):
    real_open = open

    def fake(path, mode="r", *args, **kwargs):
        if Path(path).name == name and "w" in mode:
            _enospc()
        return real_open(path, mode, *args, **kwargs)

    return fake


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", MARKER])
def test_a_full_disk_at_each_checkpoint_file_keeps_the_previous_checkpoint(tmp_path, monkeypatch, model_and_optimizer,
                                                                           name):
    model, optimizer = model_and_optimizer
    _save(tmp_path, 1, model, optimizer)
    if name == "model.safetensors":
        import safetensors.torch

        def full(*_, **__):
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        monkeypatch.setattr(run_dir_mod, "_open", _fail_opening(name))
    with pytest.raises(RunDirError, match=rf"step_000002_\d+/{name}: no space left on device \(ENOSPC\) while writing"
                                          rf".*newest complete checkpoint: .*step_000001 \(intact\)"):
        _save(tmp_path, 2, model, optimizer)
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))  # the space goes back
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000001"]
    assert load_checkpoint(complete_checkpoints(tmp_path)[0])["trainer_state"]["step"] == 1


def test_free_space_is_checked_before_a_checkpoint_is_written(tmp_path, monkeypatch, model_and_optimizer):
    model, optimizer = model_and_optimizer
    first = _save(tmp_path, 1, model, optimizer)
    size = sum(f.stat().st_size for f in first.iterdir())
    monkeypatch.setattr(run_dir_mod, "free_bytes", lambda path: size // 2)
    with pytest.raises(RunDirError, match=r"checkpoints: not enough space for checkpoint step_000002: it needs about "
                                          r"[\d.]+ KiB, [\d.]+ KiB free under .*; nothing was written; newest complete "
                                          r"checkpoint: .*step_000001 \(intact\)"):
        _save(tmp_path, 2, model, optimizer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


@contextlib.contextmanager
def _tmpfs(tmp_path: Path, size: str):
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("fail_at", ["model.safetensors", "optimizer.pt"])
def test_a_real_full_tmpfs_gives_the_clear_error(tmp_path, monkeypatch, model_and_optimizer, fail_at):
    """Real libraries on a real full file system (the space check is switched off to reach their errors): the
    safetensors "(os error 28)" and torch's "unexpected pos" both come out as the full disk, naming the file."""
    model, optimizer = model_and_optimizer
    with _tmpfs(tmp_path, "4m") as mount:
        run = mount / "run"
        first = _save(run, 1, model, optimizer)
        weights = (first / "model.safetensors").stat().st_size
        monkeypatch.setattr(run_dir_mod, "check_space", lambda *a, **k: None)
        monkeypatch.setattr("dppo.run_files.checkpoint.check_space", lambda *a, **k: None)
        leave = 4096 if fail_at == "model.safetensors" else weights + 8192  # weights fit, the optimizer does not
        ballast = mount / "ballast"
        with open(ballast, "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(mount).free - leave))
        with pytest.raises(RunDirError, match=rf"{fail_at}: no space left on device \(ENOSPC\) while writing.*"
                                              rf"step_000001 \(intact\)"):
            _save(run, 2, model, optimizer)
        assert [p.name for p in complete_checkpoints(run)] == ["step_000001"]
        load_checkpoint(first)
        ballast.unlink()  # the space is back: the next checkpoint is written
        monkeypatch.undo()
        assert [p.name for p in complete_checkpoints(_save(run, 2, model, optimizer).parents[1])] == \
            ["step_000001", "step_000002"]


# ------------------------------------------------------------------------------------------------- torn lines
def test_resume_cuts_a_torn_last_line_then_the_steps_after_the_checkpoint(tmp_path, capsys):
    lines = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in (1, 2, 3, 4))
    torn_metrics, torn_samples = '{"step": 5, "reward/mean": 0.', '{"step": 2, "comp'
    (tmp_path / "metrics.jsonl").write_text(lines + torn_metrics)
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "completion": "2"}\n' + torn_samples)
    (tmp_path / "eval.jsonl").write_text('{"step": 2, "pass@1": 0.5}\n')
    logger = RunLogger(tmp_path, total_steps=6, report_to=(), progress=False, start_step=3)
    logger.close()
    err = capsys.readouterr().err
    assert f"[dppo] warning: {tmp_path / 'metrics.jsonl'}: dropped {len(torn_metrics)} bytes of a torn last " \
        "line (the run stopped while writing it)" in err
    assert f"{tmp_path / 'samples.jsonl'}: dropped {len(torn_samples)} bytes" in err
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1, "completion": "2"}\n'
    assert (tmp_path / "eval.jsonl").read_text() == '{"step": 2, "pass@1": 0.5}\n'


def test_a_damaged_line_inside_a_log_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(RunDirError, match=r"metrics\.jsonl: line 2: not valid JSON \(Unterminated string.*\); the log "
                                          r"is damaged before its last line: fix or delete that line"):
        repair_jsonl(tmp_path, tmp_path / "metrics.jsonl", keep_step=3)


# ------------------------------------------------------------------------------------------------- trackers
def test_a_tracker_that_fails_is_dropped_and_a_full_disk_under_it_stops_the_run(tmp_path, capsys):
    class Broken:
        folder = "tb"

        def __init__(self, exc):
            self.exc, self.closed = exc, False

        def log(self, metrics, step):
            raise self.exc

        def close(self):
            self.closed = True

    logger = RunLogger(tmp_path, total_steps=2, report_to=(), progress=False)
    logger._trackers = [Broken(RuntimeError("wandb service died"))]
    logger.log_step(1, {"reward/mean": 0.5})
    assert "tracker tb failed (RuntimeError: wandb service died); it is dropped" in capsys.readouterr().out
    logger._trackers = [Broken(OSError(errno.ENOSPC, "No space left on device"))]
    with pytest.raises(RunDirError, match=r"/tb: no space left on device \(ENOSPC\)"):
        logger.log_step(2, {"reward/mean": 0.5})
    logger.close(quiet=True)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_tensorboard_on_a_real_full_tmpfs_is_the_one_error(tmp_path, capsys):
    """TensorBoard writes from a thread: its disk error comes back at a later write, as the RunDirError, and the
    thread's own traceback is not printed."""
    with _tmpfs(tmp_path, "1m") as mount:
        logger = RunLogger(mount / "run", total_steps=10_000, report_to=("tensorboard",), progress=False)
        with open(mount / "ballast", "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * shutil.disk_usage(mount).free)
        with pytest.raises(RunDirError, match=r"run/tb: no space left on device \(ENOSPC\) while writing"):
            for step in range(1, 10_000):
                logger._to_trackers({f"metric/{i}": 0.5 for i in range(50)}, step)
        logger.close(quiet=True)
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- end to end
def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", *ARGS, "--run-dir", str(run)]) == 0
    return run


class Fault:
    """ENOSPC at one write site, from the `at`-th write there on (while armed)."""

    def __init__(self, monkeypatch, site: str, at: int) -> None:
        self.site, self.at, self.seen, self.armed = site, at, 0, True
        real_write, real_open = run_dir_mod._write, run_dir_mod._open
        if site.endswith(".jsonl"):
            def write(fd, data):
                if self.armed and os.readlink(f"/proc/self/fd/{fd}").endswith(site):
                    self.seen += 1
                    if self.seen >= at:
                        real_write(fd, data[: len(data) // 3])  # a short write, then the disk is full
                        _enospc()
                return real_write(fd, data)

            monkeypatch.setattr(run_dir_mod, "_write", write)
        else:
            def opener(path, mode="r", *args, **kwargs):
                if self.armed and Path(path).name == site and "w" in mode:
                    self.seen += 1
                    if self.seen >= at:
                        _enospc()
                return real_open(path, mode, *args, **kwargs)

            monkeypatch.setattr(run_dir_mod, "_open", opener)


def _train_with_fault(monkeypatch, capsys, run: Path, site: str, at: int) -> str:
    fault = Fault(monkeypatch, site, at)
    capsys.readouterr()
    assert main(["train", *ARGS, "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    fault.armed = False
    return err


def _assert_resumes_like_the_reference(run: Path, reference: Path, capsys) -> None:
    for folder in complete_checkpoints(run):  # every checkpoint marked complete still loads
        load_checkpoint(folder)
    assert main(["train", "--resume", str(run), "--log.no-progress", "--no-hf"]) == 0
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]  # each step logged once
    assert [r["reward/mean"] for r in _rows(run)] == [r["reward/mean"] for r in _rows(reference)]
    a = load_file(str(reference / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("site, at", [
    pytest.param("metrics.jsonl", 3, id="metrics-line-of-step-3"),
    pytest.param("samples.jsonl", 3, id="samples-of-step-3", marks=pytest.mark.slow),
    pytest.param("optimizer.pt", 3, id="optimizer-of-checkpoint-3", marks=pytest.mark.slow),
    pytest.param(MARKER, 3, id="marker-of-checkpoint-3", marks=pytest.mark.slow),
])
def test_full_disk_mid_run_is_one_line_and_resume_matches_an_uninterrupted_run(reference, tmp_path, monkeypatch,
                                                                               capsys, site, at):
    run = tmp_path / "run"
    err = _train_with_fault(monkeypatch, capsys, run, site, at)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"dppo train: error: {run}/") and site in err.splitlines()[0]
    assert re.search(ONE_LINE.format(run=re.escape(str(run))), err), err
    _assert_resumes_like_the_reference(run, reference, capsys)


def test_a_full_disk_at_the_config_stops_before_training(tmp_path, monkeypatch, capsys):
    from dppo.train.config import Config

    monkeypatch.setattr(Config, "save", _enospc)
    assert main(["train", *ARGS, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^dppo train: error: .*run/config\.yaml: no space left on device \(ENOSPC\) while writing; .*no "
                     r"complete checkpoint yet", err) and "Traceback" not in err, err


def test_a_full_disk_at_the_final_model_says_the_run_finished(tmp_path, monkeypatch, capsys):
    import dppo.run_files.export as export

    monkeypatch.setattr(export, "_save", _enospc)
    run = tmp_path / "run"
    assert main(["train", *[a for a in ARGS if a != "--no-hf"], "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    final = run / "checkpoints" / "step_000004"
    assert re.fullmatch(rf"dppo train: error: {re.escape(str(final))}/\.hf\.tmp-\d+: no space left on device \(ENOSPC\) "
                        rf"while writing; .* free under {run}; the run itself finished \({final} is complete\); free "
                        rf"space, then write its model with: dppo export {run} --step 4 {final}/hf", err.strip()), err
    assert not list((run / "checkpoints" / "step_000004").glob("*hf*")) and (run / "summary.json").is_file()


# ------------------------------------------------------------------------------------------------- error policy

def test_a_bug_during_training_keeps_its_traceback(tmp_path, monkeypatch):
    """A ValueError once training runs is not an input error: `main` lets it through (the traceback is printed)."""
    from dppo.train.trainer import Trainer

    def broken(self):
        raise ValueError("shapes (4, 6) and (3, 6) do not match")

    monkeypatch.setattr(Trainer, "step", broken)
    with pytest.raises(ValueError, match="shapes"):
        main(["train", *ARGS, "--run-dir", str(tmp_path / "run")])


def test_an_input_error_is_one_line_and_debug_shows_its_traceback(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": \n')
    args = ["train", *ARGS, "--run-dir", str(tmp_path / "run"), "--task.name", "file", "--task.reward", "",
            "--task.options", json.dumps({"path": str(data)})]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"dppo train: error: .*{re.escape(str(data))}: line 2: malformed JSON: Expecting value.*",
                        err.strip()) and "Traceback" not in err, err
    assert main([*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith("malformed JSON: Expecting value")
    monkeypatch.setenv("DPPO_DEBUG", "1")
    assert main(args) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_damaged_log_on_resume_names_the_file(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], rows[1][:40], *rows[2:]]) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--log.no-progress", "--no-hf"]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"^dppo train: error: {re.escape(str(run))}/metrics\.jsonl: line 2: not valid JSON", err), err
