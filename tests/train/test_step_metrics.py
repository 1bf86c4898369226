"""The step's split metrics (`dppo.train.step_metrics`): per fleet member, staleness and turn, each a mean over every
row of the step that belongs to the part, and absent where the part had no tokens; the unsplit mismatch means stay
the first mini-batch's (before any update)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dppo.train.step_metrics import StepAccumulator, prune_unreached


def _batch(engine, staleness, turn):
    """4 rows of 3 tokens (row 3's last token is padding); µ and π's log-probs differ by row."""
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(4, 3, generator=g) * 2
    logp = -torch.rand(4, 3, generator=g) * 2
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[3, 2] = False
    extras = {"engine": torch.tensor(engine), "staleness": torch.tensor(staleness),
              "turn_index": torch.tensor(turn)[:, None].expand(4, 3).contiguous(),
              "token_staleness": torch.tensor(staleness)[:, None].expand(4, 3).contiguous()}
    batch = SimpleNamespace(loss_mask=mask, rollout_logp=mu, rollout_topk_logp=None, rollout_topk_valid=None,
                            extras=extras)
    return batch, logp


def _scores(logp, rows):
    return SimpleNamespace(logp=logp[rows], topk_logp=None, entropy=None)


def _tv(logp, mu, mask, rows):
    """Mean |π(a) − µ(a)| over the tokens of `rows`, by hand."""
    tv = (logp.exp() - mu.exp()).abs()
    return float((tv[rows] * mask[rows]).sum() / mask[rows].sum())


def _step(batch, logp, micros, *, engines=3, max_staleness=2, max_turns=3, old=None):
    acc = StepAccumulator(torch.device("cpu"), max_staleness=max_staleness, max_turns=max_turns, engines=engines)
    for i, micro in enumerate(micros):
        acc.add_mismatch(batch, micro, _scores(logp, micro), start=i == 0, old=old)
    values = {k: float(v) for k, v in acc.result_means().items()}
    values.update({f"rollout/staleness_frac_{j}": float((batch.extras["staleness"] == j).float().mean())
                   for j in range(max_staleness + 1)})
    return prune_unreached(values, max_staleness)


def test_a_part_absent_from_the_first_mini_batch_is_measured_over_the_step_and_an_empty_part_is_absent():
    """Engine 1's rows are all in the second micro-batch: its value is their mean, not 0.0; engine 2 had no rows
    (and staleness 1, turn 2): no value at all. The unsplit mean is the first mini-batch's alone."""
    batch, logp = _batch(engine=[0, 0, 1, 1], staleness=[0, 0, 2, 2], turn=[0, 0, 1, 1])
    mask, mu = batch.loss_mask, batch.rollout_logp
    micros = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    out = _step(batch, logp, micros)
    for part in ("engine", "stale", "turn"):
        assert out[f"mismatch/binary_tv_{part}_0"] == pytest.approx(_tv(logp, mu, mask, [0, 1]))
    assert out["mismatch/binary_tv_engine_1"] == pytest.approx(_tv(logp, mu, mask, [2, 3]))
    assert out["mismatch/binary_tv_stale_2"] == pytest.approx(_tv(logp, mu, mask, [2, 3]))
    assert out["mismatch/binary_tv_turn_1"] == pytest.approx(_tv(logp, mu, mask, [2, 3]))
    assert out["rollout/staleness_turn_1"] == pytest.approx(2.0)
    for gone in ("mismatch/binary_tv_engine_2", "mismatch/binary_tv_stale_1", "mismatch/binary_tv_turn_2",
                 "rollout/staleness_turn_2"):
        assert gone not in out
    assert not [k for k in out if k.startswith("count/")]
    assert out["mismatch/binary_tv_mean"] == pytest.approx(_tv(logp, mu, mask, [0, 1]))


def test_with_pi_old_the_splits_are_the_whole_batch_before_any_update():
    """Given π_old's scores of the whole batch (loss.split_mismatch, the recompute anchor), every split is read from
    them, whatever π the micro-batches were scored with."""
    batch, logp = _batch(engine=[1, 0, 1, 0], staleness=[0, 1, 0, 1], turn=[0, 0, 0, 0])
    old_logp = logp - 0.3
    old = SimpleNamespace(logp=old_logp, topk_logp=None)
    mask, mu = batch.loss_mask, batch.rollout_logp
    out = _step(batch, logp, [torch.tensor([0, 1]), torch.tensor([2, 3])], engines=2, max_staleness=1, old=old)
    assert out["mismatch/binary_tv_engine_1"] == pytest.approx(_tv(old_logp, mu, mask, [0, 2]))
    assert out["mismatch/binary_tv_engine_0"] == pytest.approx(_tv(old_logp, mu, mask, [1, 3]))
    assert out["mismatch/binary_tv_stale_1"] == pytest.approx(_tv(old_logp, mu, mask, [1, 3]))
    assert out["mismatch/binary_tv_mean"] == pytest.approx(_tv(logp, mu, mask, [0, 1]))  # (π's, first mini-batch)
