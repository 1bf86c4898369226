"""`log.grad_snr`: the trainer's `ledger/grad_snr` against the definition evaluated on the gradients themselves,
copied at every optimiser step of a real tiny run (before clipping, as the guard sees them)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import smoke_config
from dppo.train.trainer import Trainer


def snr_by_definition(grads: list[list[torch.Tensor]]) -> float:
    """‖ḡ‖² / (mean_i ‖g_i − ḡ‖² / M), each g_i the concatenation of one optimiser step's gradients."""
    flat = torch.stack([torch.cat([g.double().flatten() for g in step]) for step in grads])
    mean = flat.mean(0)
    var = (flat - mean).square().sum(1).mean()
    return float(mean.square().sum() / (var / len(grads)))


def test_the_logged_snr_is_the_definition_on_the_steps_gradients(tmp_path):
    cfg = smoke_config(tmp_path, train={"steps": 2, "mini_batches": 4, "threads": 1}, log={"grad_snr": True},
                       optim={"grad_clip": 0.05})  # a clip that bites: the SNR is of the gradients before it
    trainer = Trainer(cfg, tmp_path)
    seen: list[list[torch.Tensor]] = []
    step = trainer.optim.step

    def recording_step(loss_finite, idx):
        seen.append([p.grad.detach().clone() for p in trainer.params if p.grad is not None])
        return step(loss_finite, idx)

    trainer.optim.step = recording_step
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == 8 and len(rows) == 2
    for i, row in enumerate(rows):
        want = snr_by_definition(seen[4 * i: 4 * i + 4])
        assert row["ledger/grad_snr"] == pytest.approx(want, rel=1e-4)
    assert rows[0]["ledger/grad_snr"] != pytest.approx(rows[1]["ledger/grad_snr"], rel=1e-3)


def test_off_by_default_and_absent_with_one_optimiser_step(tmp_path):
    for name, sections in {"default": {"train": {"mini_batches": 4}},
                           "one": {"train": {"mini_batches": 1}, "log": {"grad_snr": True}}}.items():
        run_dir = tmp_path / name
        trainer = Trainer(smoke_config(run_dir, **{k: {**v, "steps": 1, "threads": 1} if k == "train" else v
                                                    for k, v in sections.items()}), run_dir)
        try:
            trainer.train()
        finally:
            trainer.close()
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert "ledger/grad_snr" not in row and "ledger/masked_mass" in row
