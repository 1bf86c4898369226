"""Training precision (`model.precision`): the `auto` rule with faked hardware, the config's refusals,
the resolved value in config.yaml, fp16's loss scaling (a step whose gradients overflow is skipped, counted,
and the weights and optimiser state are untouched), and π's log-probs staying float32 under every autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dppo.runtime import hardware
from dppo.train.batch import collate
from dppo.train.resolve import resolve_config
from dppo.train.config import Config, ConfigError, replace
from dppo.train.distributed import Dist
from dppo.train.optim import GuardedOptimizer
from dppo.train.presets import get_preset
from dppo.train.scoring import autocast_dtype
from dppo.train.trainer import Trainer
from conftest import smoke_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}  # Zen 4, Cooper Lake
SAPPHIRE = AVX2 | {"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"}  # AMX-BF16, no AMX-FP16
GRANITE = SAPPHIRE | {"amx_fp16", "avx512_fp16"}  # AMX-FP16 (Granite Rapids)
ARM_BF16 = frozenset({"fp", "asimd", "bf16"})


@pytest.mark.parametrize("flags, expected", [(AVX2, "fp32"), (AVX512_BF16, "bf16"), (SAPPHIRE, "bf16"),
                                             (ARM_BF16, "bf16"), (frozenset(), "fp32")])
def test_auto_precision_is_bf16_autocast_where_bf16_is_native_on_cpu(flags, expected):
    choice, warning = hardware.resolve_precision("auto", CPU, "float32", flags=flags)
    assert choice.value == expected and warning is None
    assert ("bf16 autocast, float32 master weights" in choice.reason) == (expected == "bf16")


@pytest.mark.parametrize("bf16, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_on_cuda_follows_the_device(bf16, expected):
    assert hardware.resolve_precision("auto", CUDA, "float32", cuda_bf16=bf16)[0].value == expected


def test_bfloat16_weights_compute_in_bf16_and_refuse_fp32_or_fp16():
    assert hardware.resolve_precision("auto", CPU, "bfloat16", flags=AVX2)[0] == ("bf16", "model.dtype is bfloat16")
    for precision in ("fp32", "fp16"):
        with pytest.raises(ConfigError, match=rf"model.precision: {precision} needs float32 master weights"):
            replace(Config(), model={"dtype": "bfloat16", "precision": precision})


def test_explicit_precisions_warn_where_they_are_emulated():
    choice, warning = hardware.resolve_precision("bf16", CPU, "float32", flags=AVX2)
    assert choice == ("bf16", "as configured") and "emulated" in warning and "auto picks fp32" in warning
    assert hardware.resolve_precision("bf16", CPU, "float32", flags=SAPPHIRE)[1] is None
    assert "no native fp16" in hardware.resolve_precision("fp16", CPU, "float32", flags=SAPPHIRE)[1]
    assert hardware.resolve_precision("fp16", CPU, "float32", flags=GRANITE)[1] is None
    assert hardware.resolve_precision("fp16", CUDA, "float32", cuda_bf16=False)[1] is None
    assert hardware.resolve_precision("fp32", CPU, "float32", flags=SAPPHIRE) == (("fp32", "as configured"), None)


@pytest.mark.parametrize("env, expected", [("avx2 fma", "fp32"), ("avx2 amx_bf16", "bf16")])
def test_config_yaml_records_the_precision_auto_chose(monkeypatch, env, expected):
    monkeypatch.setenv("DPPO_CPU_FLAGS", env)
    hardware.cpu_flags.cache_clear()
    try:
        resolved = resolve_config(replace(get_preset("demo"), model={"device": "cpu"}))
        assert resolved.model.precision == expected
        assert resolve_config(resolved) == resolved  # idempotent: a resumed run reads exactly it
        assert Config.from_dict(resolved.to_dict()).model.precision == expected
    finally:
        monkeypatch.delenv("DPPO_CPU_FLAGS")
        hardware.cpu_flags.cache_clear()


@pytest.mark.parametrize("old", [True, False])
def test_a_config_yaml_with_the_old_autocast_field_is_refused_naming_its_new_place(old):
    data = Config().to_dict()
    data["model"].pop("precision")
    data["model"]["autocast_bf16"] = old
    with pytest.raises(ConfigError, match=r"^model\.autocast_bf16: config was written by an older dppo; edit it: "
                                          r"model\.autocast_bf16 is now model\.precision \(true: bf16, false: fp32\)$"):
        Config.from_dict(data)


def test_autocast_dtype_is_none_when_the_weights_already_have_it():
    assert autocast_dtype("fp32", torch.float32) is None
    assert autocast_dtype("bf16", torch.float32) is torch.bfloat16
    assert autocast_dtype("fp16", torch.float32) is torch.float16
    assert autocast_dtype("bf16", torch.bfloat16) is None


def _fp16_optimizer(model: nn.Module, announced: list[str]) -> GuardedOptimizer:
    return GuardedOptimizer(model, list(model.parameters()), Dist(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.0,
                            warmup_steps=0, grad_clip=1.0, max_consecutive_skips=3, announce=announced.append,
                            loss_scaling=True)


def _set_loss_scale(opt: GuardedOptimizer, scale: float) -> None:
    """Set the fp16 loss scale of `opt` (its scaler's state otherwise as it is)."""
    opt.scaler.load_state_dict({**opt.scaler.state_dict(), "scale": float(scale)})


def _fp16_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x).float().pow(2).mean()


def test_fp16_loss_scaling_skips_an_overflowing_step_and_counts_it():
    torch.manual_seed(0)
    model, x, announced = nn.Linear(8, 8), torch.randn(4, 8), []
    opt = _fp16_optimizer(model, announced)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _set_loss_scale(opt, 2.0 ** 120)  # scaled gradients beyond fp16's 65504: the backward overflows
    loss = _fp16_loss(model, x)
    opt.backward(loss)
    opt.step(torch.isfinite(loss.detach()), step=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights untouched
    assert not opt.optimizer.state  # nor the optimiser state (no moment was created)
    assert (opt.skipped_steps, opt.overflow_steps, opt.consecutive_skips) == (1, 1, 1)
    assert opt.loss_scale == 2.0 ** 119  # backed off
    assert "fp16 gradient (overflow; loss scale now" in announced[0]

    _set_loss_scale(opt, 2.0 ** 10)  # a scale that fits: the step applies, unscaled
    loss = _fp16_loss(model, x)
    opt.backward(loss)
    norm = opt.step(torch.isfinite(loss.detach()), step=2)
    assert not torch.equal(before["weight"], model.weight) and opt.consecutive_skips == 0
    ref = nn.Linear(8, 8)
    ref.load_state_dict(before)
    _fp16_loss(ref, x).backward()  # the same gradients without any scale
    assert norm.item() == pytest.approx(torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item(), rel=1e-3)
    assert opt.state_dict()["grad_scaler"]["scale"] == 2.0 ** 10  # (no growth yet: growth_interval 2000)


def test_fp16_a_non_finite_loss_is_skipped_and_the_next_step_still_runs():
    model, announced = nn.Linear(8, 8), []
    opt = _fp16_optimizer(model, announced)
    x = torch.randn(4, 8)
    loss = _fp16_loss(model, x) * float("nan")
    opt.backward(loss)
    opt.step(torch.isfinite(loss.detach()), step=1)
    assert (opt.skipped_steps, opt.overflow_steps) == (1, 0) and "non-finite loss" in announced[0]
    before = model.weight.detach().clone()
    loss = _fp16_loss(model, x)
    opt.backward(loss)  # the scaler was updated on the skip: unscale_ may run again
    opt.step(torch.isfinite(loss.detach()), step=2)
    assert opt.consecutive_skips == 0 and not torch.equal(before, model.weight)


def test_fp16_overflows_count_towards_the_skip_limit():
    model, announced = nn.Linear(8, 8), []
    opt = _fp16_optimizer(model, announced)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="3 consecutive optimiser steps skipped"):
        for step in range(1, 5):
            _set_loss_scale(opt, 2.0 ** 120)
            loss = _fp16_loss(model, x)
            opt.backward(loss)
            opt.step(torch.isfinite(loss.detach()), step=step)


def test_fp16_trainer_with_fp16_engine_trains_and_its_scale_survives_a_resume(tmp_path):
    cfg = smoke_config(tmp_path, model={"precision": "fp16"}, rollout={"dtype": "float16"},
                       train={"steps": 2})
    with Trainer(cfg, tmp_path) as trainer:
        assert trainer.autocast is torch.float16 and trainer.optim.scaler is not None
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        _set_loss_scale(trainer.optim, 2.0 ** 120)  # the first step's gradients overflow
        first = trainer.step()
        assert first["optim/overflow_steps_total"] >= 1 and first["optim/skipped_steps_total"] >= 1
        assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
        _set_loss_scale(trainer.optim, 2.0 ** 10)
        second = trainer.step()
        assert second["optim/skipped_steps_total"] == first["optim/skipped_steps_total"]  # nothing more skipped
        assert second["optim/loss_scale"] == 2.0 ** 10
        assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
        scale, overflows = trainer.optim.loss_scale, trainer.optim.overflow_steps
        assert scale < 2.0 ** 120
        trainer.save()
    with Trainer(cfg, tmp_path, resume=True) as resumed:
        assert (resumed.optim.loss_scale, resumed.optim.overflow_steps) == (scale, overflows)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_pi_log_probs_are_float32_under_every_precision(tmp_path, chat_prompts, precision):
    """The importance weight and the divergences read π's log-probs: float32 whatever the autocast (the fused
    lm-head + log-softmax follows the float32 hidden state), and within the autocast's rounding of fp32's."""
    cfg = smoke_config(tmp_path, model={"precision": precision})
    with Trainer(cfg, tmp_path) as trainer:
        batch = collate(trainer.engine.generate(chat_prompts, trainer._sampling_params(0)), pad_id=trainer.pad_id)
        idx = torch.arange(batch.response_ids.shape[0])
        scores = trainer._score(batch, idx, grad=False)
        trainer.autocast = None
        ref = trainer._score(batch, idx, grad=False)
    mask = batch.response_mask
    assert scores.logp.dtype == torch.float32
    bound = {"fp32": 0.0, "bf16": 0.1, "fp16": 0.01}[precision]
    assert (scores.logp - ref.logp)[mask].abs().max().item() <= bound
