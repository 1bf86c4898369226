"""The step's split metrics (`dppo.train.step_metrics`, `dppo.train.batch.minibatches`): per fleet member, staleness
and turn, each over the same tokens as the unsplit mismatch (the first mini-batch, before any update; with π_old the
whole step), absent where the part had no tokens; the mini-batches dealt out by fleet member and staleness, so the
first one holds every part the step has."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dppo.train.batch import group_strata, minibatches
from dppo.train.step_metrics import StepAccumulator, prune_unreached


def _batch(engine, staleness, turn):
    """4 rows of 3 tokens (row 3's last token is padding); µ and π's log-probs differ by row."""
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(4, 3, generator=g) * 2
    logp = -torch.rand(4, 3, generator=g) * 2
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[3, 2] = False
    batch = SimpleNamespace(loss_mask=mask, rollout_logp=mu, rollout_topk_logp=None, rollout_topk_valid=None,
                            engine=torch.tensor(engine), staleness=torch.tensor(staleness),
                            turn_index=torch.tensor(turn)[:, None].expand(4, 3).contiguous(),
                            token_staleness=torch.tensor(staleness)[:, None].expand(4, 3).contiguous())
    return batch, logp


def _tv(logp, mu, mask, rows):
    """Mean |π(a) − µ(a)| over the tokens of `rows`, by hand."""
    tv = (logp.exp() - mu.exp()).abs()
    return float((tv[rows] * mask[rows]).sum() / mask[rows].sum())


def _result(acc, batch, max_staleness):
    values = {k: float(v) for k, v in acc.result_means().items()}
    values.update({f"rollout/staleness_frac_{j}": float((batch.staleness == j).float().mean())
                   for j in range(max_staleness + 1)})
    return prune_unreached(values, max_staleness)


def test_the_splits_cover_the_unsplit_tokens_and_a_part_without_tokens_is_absent_not_zero():
    """The first mini-batch holds rows 0-1 (engine 0, staleness 0, turn 0) and row 2 (engine 1, staleness 2, turn 1):
    each split's part is the mean over its tokens there; engine 2, staleness 1 and turn 2 had none and are absent
    (they were logged as 0.0); a part holding every token would equal the unsplit mean."""
    batch, logp = _batch(engine=[0, 0, 1, 1], staleness=[0, 0, 2, 2], turn=[0, 0, 1, 1])
    mask, mu = batch.loss_mask, batch.rollout_logp
    acc = StepAccumulator(torch.device("cpu"), max_staleness=2, max_turns=3, engines=3)
    first = torch.tensor([0, 1, 2])
    acc.add_mismatch(batch, first, logp[first], None)
    acc.begin(batch, None)
    out = _result(acc, batch, 2)
    for part in ("engine", "stale", "turn"):
        assert out[f"mismatch/binary_tv_{part}_0"] == pytest.approx(_tv(logp, mu, mask, [0, 1]))
    assert out["mismatch/binary_tv_engine_1"] == pytest.approx(_tv(logp, mu, mask, [2]))
    assert out["mismatch/binary_tv_stale_2"] == pytest.approx(_tv(logp, mu, mask, [2]))
    assert out["mismatch/binary_tv_turn_1"] == pytest.approx(_tv(logp, mu, mask, [2]))
    assert out["mismatch/binary_tv_mean"] == pytest.approx(_tv(logp, mu, mask, [0, 1, 2]))
    assert out["rollout/staleness_turn_1"] == pytest.approx(2.0)  # (the whole batch: no π needed)
    for gone in ("mismatch/binary_tv_engine_2", "mismatch/binary_tv_stale_1", "mismatch/binary_tv_turn_2",
                 "rollout/staleness_turn_2"):
        assert gone not in out
    assert not [k for k in out if k.startswith("count/")]


def test_with_pi_old_every_row_of_the_step_is_measured():
    """Given π_old's log-probs of the whole batch (loss.split_mismatch, the recompute anchor): every row."""
    batch, logp = _batch(engine=[1, 0, 1, 0], staleness=[0, 1, 0, 1], turn=[0, 0, 0, 0])
    mask, mu = batch.loss_mask, batch.rollout_logp
    acc = StepAccumulator(torch.device("cpu"), max_staleness=1, max_turns=0, engines=2)
    acc.begin(batch, SimpleNamespace(logp=logp, topk_logp=None))
    acc.add_before_update(batch, torch.tensor([0, 1]), SimpleNamespace(logp=logp[:2] + 1.0, topk_logp=None,
                                                                       entropy=None))  # (π's: not the mismatch)
    out = _result(acc, batch, 1)
    assert out["mismatch/binary_tv_engine_1"] == pytest.approx(_tv(logp, mu, mask, [0, 2]))
    assert out["mismatch/binary_tv_engine_0"] == pytest.approx(_tv(logp, mu, mask, [1, 3]))
    assert out["mismatch/binary_tv_stale_1"] == pytest.approx(_tv(logp, mu, mask, [1, 3]))
    assert out["mismatch/binary_tv_mean"] == pytest.approx(_tv(logp, mu, mask, [0, 1, 2, 3]))


@pytest.mark.parametrize("step", range(6))
def test_every_mini_batch_with_room_holds_a_group_of_every_fleet_member(step):
    """9 groups of 2 rows, fleet members 0,1,2 in turn, 3 mini-batches of 3 groups: with the members as strata every
    mini-batch holds each member once (a plain shuffle leaves members out of the first, where the mismatch is
    measured), and the mini-batches still partition the batch in whole groups."""
    groups = torch.arange(18) // 2
    engine = groups % 3
    strata = group_strata(SimpleNamespace(engine=engine), groups)
    mbs = minibatches(groups, 3, seed=0, step=step, epoch=0, device=torch.device("cpu"), strata=strata)
    assert sorted(torch.cat(mbs).tolist()) == list(range(18)) and all(len(mb) == 6 for mb in mbs)
    assert all(set(groups[mb].tolist()) <= set(groups[mb][::2].tolist()) for mb in mbs)  # (whole groups)
    assert all(sorted(engine[mb][::2].tolist()) == [0, 1, 2] for mb in mbs)
    plain = minibatches(groups, 3, seed=0, step=step, epoch=0, device=torch.device("cpu"))
    assert sorted(torch.cat(plain).tolist()) == list(range(18))
    assert group_strata(SimpleNamespace(engine=torch.zeros(18, dtype=torch.long)), groups) is None
    assert group_strata(SimpleNamespace(engine=None), groups) is None


def test_a_plain_shuffle_does_leave_a_member_out_of_the_first_mini_batch():
    """What the strata are for: over a few steps, the unstratified first mini-batch misses a member."""
    groups = torch.arange(18) // 2
    engine = groups % 3
    firsts = [minibatches(groups, 3, seed=0, step=s, epoch=0, device=torch.device("cpu"))[0] for s in range(6)]
    assert any(set(engine[mb].tolist()) != {0, 1, 2} for mb in firsts)
