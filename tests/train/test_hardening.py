"""Hardening of the training loop: graceful stop on SIGINT/SIGTERM, non-finite loss and gradient guards.

All on the `smoke` preset (tiny random model, built-in shaped reward); the whole file runs in well under a minute.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dppo.train.trainer as trainer_mod
from dppo.cli import main
from dppo.train.config import ConfigError, replace
from dppo.train.presets import get_preset
from dppo.train.trainer import Trainer
from conftest import smoke_config

REPO = Path(__file__).resolve().parents[2]


def _cfg(run_dir, **train):
    """The smoke preset with one optimiser step per training step unless `train` says otherwise."""
    return smoke_config(run_dir, train={"steps": 3, "mini_batches": 1, **train})


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _unchanged(before, trainer):
    return all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def _poison_loss(monkeypatch, poison):
    """Make the policy loss NaN on the calls (one per micro-batch) for which `poison(call_index)` is true."""
    from dppo.losses import LOSSES

    real, calls = LOSSES["masked_is"], itertools.count()

    def wrapped(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan") if poison(next(calls)) else loss), stats

    monkeypatch.setitem(LOSSES, "masked_is", wrapped)  # the trainer looks its loss up when it is built


def _rows(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# ---------------------------------------------------------------------------------------------- graceful stop
def test_sigterm_checkpoints_the_current_step_exits_0_and_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dppo.cli", "train", "--preset", "smoke", "--train.steps", "50", "--run-dir", str(run),
           "--log.no-progress", "--log.report-to", "none", "--train.no-eval-before"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _rows(run):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step logged within 60 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    last = _rows(run)[-1]["step"]
    assert 1 <= last < 50 and [r["step"] for r in _rows(run)] == list(range(1, last + 1))
    assert f"stopped by signal at step {last}; resume with: dppo train --resume {run}" in out, out
    assert (run / "checkpoints" / f"step_{last:06d}" / "COMPLETE").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["step"] == last and summary["signal"] == "SIGTERM"
    # resume continues right after the checkpointed step
    assert main(["train", "--resume", str(run), "--train.steps", str(last + 1), "--log.no-progress"]) == 0
    assert [r["step"] for r in _rows(run)] == list(range(1, last + 2))
    assert (run / "checkpoints" / f"step_{last + 1:06d}" / "COMPLETE").is_file()


def test_sigint_stops_after_the_step_and_restores_the_handlers(tmp_path, monkeypatch):
    trainer = Trainer(_cfg(tmp_path, steps=10), tmp_path)
    real_step = trainer.step

    def step():
        if trainer.step_idx == 1:  # a Ctrl-C in the middle of step 2
            os.kill(os.getpid(), signal.SIGINT)
        return real_step()

    monkeypatch.setattr(trainer, "step", step)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        results = trainer.train()
    finally:
        trainer.close()
    assert results["stopped_early"] is True and results["step"] == 2 and results["signal"] == "SIGINT"
    assert results["checkpoint"].endswith("step_000002") and (Path(results["checkpoint"]) / "COMPLETE").is_file()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_signal_is_not_deferred(tmp_path, monkeypatch):
    # Precondition: Python's own SIGINT handler. A process started in the background by a non-interactive shell
    # (`cmd &`) inherits SIGINT ignored, and Python then installs no handler: the second signal would be ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer = Trainer(_cfg(tmp_path, steps=10), tmp_path)
    real_step = trainer.step

    def step():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the previous handler is back: KeyboardInterrupt now
        return real_step()

    monkeypatch.setattr(trainer, "step", step)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        trainer.close()
        handler_after = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
    assert handler_after is signal.default_int_handler


# ------------------------------------------------------------------------------------------- numerical guards
def test_nan_loss_skips_the_update_and_the_next_step_trains(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, lambda call: call == 0)
    trainer = Trainer(_cfg(tmp_path), tmp_path)
    try:
        before = _weights(trainer)
        m1 = trainer.step()
        assert _unchanged(before, trainer), "a NaN loss changed the weights"
        assert not trainer.optimizer.state, "a NaN loss touched the optimiser state"
        # the NaN loss really gives a non-finite gradient norm (and is also caught on its own)
        assert m1["optim/nonfinite_grad_steps"] == 1.0 and m1["optim/nonfinite_loss_steps"] == 1.0
        assert m1["optim/skipped_steps_total"] == 1.0
        m2 = trainer.step()
    finally:
        trainer.close()
    assert not _unchanged(before, trainer), "the step after a skipped one did not train"
    assert m2["optim/nonfinite_grad_steps"] == 0.0 and m2["optim/skipped_steps_total"] == 1.0
    assert trainer.optim.consecutive_skips == 0


def test_nan_rollout_logp_of_an_active_token_skips_the_update(tmp_path, monkeypatch):
    real_collate = trainer_mod.collate

    def collate(*args, **kwargs):
        batch = real_collate(*args, **kwargs)
        i, j = batch.response_mask.nonzero()[0].tolist()
        batch.rollout_logp[i, j] = float("nan")
        return batch

    monkeypatch.setattr(trainer_mod, "collate", collate)
    trainer = Trainer(_cfg(tmp_path), tmp_path)
    try:
        before = _weights(trainer)
        m = trainer.step()
    finally:
        trainer.close()
    assert _unchanged(before, trainer)
    assert m["optim/nonfinite_grad_steps"] == 1.0 and m["optim/skipped_steps_total"] == 1.0


def _inf_grad_once(trainer, name):
    param = dict(trainer.model.named_parameters())[name]
    fired = []

    def hook(grad):
        if not fired:
            fired.append(True)
            return torch.full_like(grad, float("inf"))
        return grad

    return param.register_hook(hook)


def test_inf_gradient_skips_the_update_and_is_counted(tmp_path):
    trainer = Trainer(_cfg(tmp_path), tmp_path)
    try:
        name = next(n for n, p in trainer.model.named_parameters() if p.requires_grad)
        _inf_grad_once(trainer, name)
        before = _weights(trainer)
        m1 = trainer.step()
        assert _unchanged(before, trainer)
        assert m1["optim/nonfinite_grad_steps"] == 1.0 and m1["optim/nonfinite_loss_steps"] == 0.0
        assert m1["optim/skipped_steps_total"] == 1.0 and trainer.optim.consecutive_skips == 1
        trainer.step()
    finally:
        trainer.close()
    assert not _unchanged(before, trainer) and trainer.optim.consecutive_skips == 0


def test_consecutive_nan_losses_stop_the_run_naming_the_step(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, lambda call: True)
    cfg = _cfg(tmp_path, steps=10, mini_batches=2)  # two optimiser steps per step: the 5th skip is in step 3
    assert cfg.train.max_consecutive_skips == 5
    trainer = Trainer(cfg, tmp_path)
    try:
        before = _weights(trainer)
        with pytest.raises(RuntimeError, match=r"step 3: 5 consecutive optimiser steps skipped.*"
                                               r"train\.max_consecutive_skips = 5.*first non-finite tensor: loss \(at step 1\)"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.step_idx == 2 and trainer.optim.skipped_steps == 5 and _unchanged(before, trainer)


def test_consecutive_inf_gradients_name_the_parameter(tmp_path):
    trainer = Trainer(_cfg(tmp_path, max_consecutive_skips=1), tmp_path)
    try:
        name = [n for n, p in trainer.model.named_parameters() if p.requires_grad][-1]
        _inf_grad_once(trainer, name)
        with pytest.raises(RuntimeError, match=rf"step 1: .*first non-finite tensor: gradient of {name.replace('.', '[.]')}"):
            trainer.step()
    finally:
        trainer.close()


def test_skips_that_are_not_consecutive_do_not_stop_the_run(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, lambda call: call % 2 == 0)  # every other optimiser step
    trainer = Trainer(_cfg(tmp_path, steps=2, mini_batches=2, max_consecutive_skips=2), tmp_path)
    try:
        for _ in range(2):
            m = trainer.step()
    finally:
        trainer.close()
    assert m["optim/skipped_steps_total"] == 2.0 and m["optim/nonfinite_loss_steps"] == 1.0


def test_max_consecutive_skips_is_validated():
    with pytest.raises(ConfigError, match=r"train\.max_consecutive_skips"):
        replace(get_preset("smoke"), train={"max_consecutive_skips": 0})


NAN_REWARD = '''
def nan_once(completion, example):
    import os
    flag = os.environ["DPPO_TEST_NAN_FLAG"]
    if not os.path.exists(flag):
        open(flag, "w").close()
        return float("nan")
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''


def test_nan_reward_skips_the_update_names_the_task_and_counts(tmp_path, monkeypatch, capsys):
    from dppo.train.trainer import Trainer

    path = tmp_path / "nan_reward.py"
    path.write_text(NAN_REWARD)
    monkeypatch.setenv("DPPO_TEST_NAN_FLAG", str(tmp_path / "flag"))
    cfg = smoke_config(tmp_path / "run", task={"reward": f"{path}:nan_once"}, train={"steps": 2, "mini_batches": 1})
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        m1 = trainer.step()
        assert m1["reward/nonfinite_steps"] == 1.0 and m1["optim/skipped_steps_total"] == 1.0
        assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        err = capsys.readouterr()
        assert "task 'addition'" in err.out + err.err and "nan" in (err.out + err.err).lower()
        m2 = trainer.step()  # the reward is fine again: training resumes
        assert "reward/mean" in m2
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        assert trainer.step_idx == 2
    finally:
        trainer.close()


def test_nan_logits_from_the_model_skip_the_update_and_are_counted(tmp_path):
    """NaN produced inside the policy's forward (the decoder's final hidden states, which feed the lm-head)."""
    trainer = Trainer(_cfg(tmp_path), tmp_path)
    try:
        norm = trainer.model.get_decoder().norm
        fired = []

        def poison(module, inputs, output):
            if not fired:
                fired.append(True)
                return output * float("nan")
            return output

        handle = norm.register_forward_hook(poison)
        before = _weights(trainer)
        m1 = trainer.step()
        handle.remove()
        assert fired and _unchanged(before, trainer)
        assert m1["optim/nonfinite_grad_steps"] == 1.0 and m1["optim/skipped_steps_total"] == 1.0
        trainer.step()
    finally:
        trainer.close()
    assert not _unchanged(before, trainer)
