"""The option cross-product of the trainer's forward and loss, each cell against the obviously-correct reference.

Options that change what the trainer computes: scoring layout (auto/packed/shared) x gradient checkpointing x
bf16 autocast x anchor (rollout/recompute) x loss (every registered trust region with `masked_is`, and `drpo`) x
micro-batching (one micro-batch or micro-batches of 3 sequences that split groups) x LoRA. The full product has
960 cells; the test runs a pairwise-covering sample of it (every value of every option meets every value of every
other option at least once), drawn greedily with a fixed seed: `CELLS`, each named in its test id.

A cell either
- is refused before any model loads, with a ConfigError naming the field (shared layout with gradient
  checkpointing; drpo with the recompute anchor), or
- gives, for one optimiser step of `Trainer._update` on a fixed rollout batch, the gradient of the reference:
  `score_responses_reference` (each sequence run whole through the model, full log-softmax) followed by the
  plain `LOSSES` entry on the whole batch; and `loss/policy` equals the reference loss.

The batch is sampled by the hf engine in bf16 (pinned: `auto` would choose by machine) from the trainer's own weights
at temperature 0.25 (peaked distributions), then µ is moved far from π on a fixed half of the tokens (log µ = log π
± 1.2, and µ's top-K cells scaled by e^-1.2; the tokens of SAT's tail by −2.0, so that its quantile sits in a gap):
every trust region masks some tokens and keeps others, with divergences far from the thresholds, so bf16 rounding
cannot flip a mask decision.

Tolerances. float32: the same math in another order (packed/shared rows, micro-batch sums, checkpoint
recomputation): measured relative error of the gradient <= 5.6e-7, asserted < 1e-4. bf16 autocast (the reference
runs under the same autocast): bf16 matmuls in another order differ by ~1e-2 relative per logit; measured
<= 8.3e-3 on the whole gradient, asserted < 5e-2. Either bound is far below what a wrong cell gives (a dropped
micro-batch, a missing 1/n, LoRA gradients lost to checkpointing: relative error >= 0.3).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from contextlib import nullcontext

import pytest
import torch

from dppo.train.config import ConfigError
from dppo.divergence import topk_kl, topk_tv
from dppo.losses import LOSSES, TokenInputs
from dppo.train.scoring import score_responses_reference
from dppo.trust_region import TRUST_REGIONS
from conftest import smoke_config

OPTIONS = {
    "layout": ("auto", "packed", "shared"),
    "ckpt": (False, True),
    "autocast": (False, True),
    "anchor": ("rollout", "recompute"),
    "loss": (*TRUST_REGIONS, "drpo"),
    "micro": (8, 3),
    "lora": (0, 4),
}
P, G, K = 4, 2, 4
SET = {"relax_alpha": 0.1,  # no default
       "neg_delta": 0.02}  # (default 0.5) so that pg_is_neg_mask masks tokens of this small model's batch


def _pairwise_cells(seed: int = 0) -> list[dict]:
    """A greedy pairwise-covering sample of the product of OPTIONS (deterministic for a seed)."""
    names = list(OPTIONS)
    product = [dict(zip(names, values)) for values in itertools.product(*OPTIONS.values())]
    rng = random.Random(seed)
    rng.shuffle(product)
    pairs = lambda cell: {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}  # noqa: E731
    uncovered = set().union(*(pairs(c) for c in product))
    cells = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        cells.append(best)
        uncovered -= pairs(best)
    return cells


CELLS = _pairwise_cells()


def _cell_id(cell: dict) -> str:
    return "-".join([cell["loss"], cell["anchor"], cell["layout"], f"mb{cell['micro']}"]
                    + [k for k in ("ckpt", "autocast") if cell[k]] + (["lora"] if cell["lora"] else []))


def _config(cell: dict, run_dir):
    region = cell["loss"] if cell["loss"] != "drpo" else "dppo_binary_tv"
    loss = {"loss": "drpo" if cell["loss"] == "drpo" else "masked_is", "trust_region": region, "anchor": cell["anchor"],
            **{k: v for k, v in SET.items() if k in TRUST_REGIONS[region].params}}
    return smoke_config(
        run_dir, model={"gradient_checkpointing": cell["ckpt"], "precision": "bf16" if cell["autocast"] else "fp32", "lora_rank": cell["lora"]},
        rollout={"prompts_per_step": P, "group_size": G, "max_new_tokens": 6, "top_k_logprobs": K,
                 "temperature": 0.25,  # peaked distributions: large divergences where µ is moved
                 # pinned, not `auto` (which picks by machine): every machine tests the same cells, and the bf16
                 # engine against the fp32 trainer is a real mismatch (µ ≠ π) under the shifts of `_far_batch`
                 "engine": "hf", "dtype": "bfloat16"},
        loss=loss, optim={"grad_clip": 0.0},
        train={"mini_batches": 1, "micro_batch_size": cell["micro"], "scoring_layout": cell["layout"]})


def _refusal(cell: dict) -> str | None:
    """The field a refused cell's error names (None: the cell must train); the loss section is checked before the
    cross-section rules, so a cell refused for both names loss.anchor."""
    if cell["loss"] == "drpo" and cell["anchor"] == "recompute":
        return "loss.anchor"
    if cell["layout"] == "shared" and cell["ckpt"]:
        return "train.scoring_layout"
    return None


def _far_batch(trainer):
    """P·G responses sampled from the trainer's weights; µ moved far from π on a fixed half of the tokens."""
    from dppo.train.batch import collate
    from dppo.train.evaluation import engine_prompts

    examples = trainer.train_examples[:P]
    batch = collate(trainer.engine.generate(engine_prompts(examples, trainer.tokenizer), trainer._sampling_params(0)),
                    pad_id=trainer.pad_id)
    gen = torch.Generator().manual_seed(7)
    far = (torch.rand(batch.response_mask.shape, generator=gen) < 0.5) & batch.response_mask
    up = torch.rand(batch.response_mask.shape, generator=gen) < 0.5  # µ above π, or below
    # the other tokens move by ±0.05 so that no π/µ sits at 1 within kernel noise (CPPO's mask flips on the sign of
    # log π − log µ once a sequence's budget is spent: a tie there made the reference and the trainer disagree)
    shift = torch.where(far, torch.where(up, 1.2, -1.2), torch.where(up, 0.05, -0.05))
    # SAT's tail (tokens above the q-quantile of |log π − log µ| over the batch) made unambiguous: the tokens ranked
    # above the quantile's position q·(n−1) move by −2.0 (µ below π, never clamped), the quantile falls in the gap
    # between 1.2 and 2.0, and no rounding (bf16 engine, autocast) moves a token across it
    n = int(batch.response_mask.sum())
    q = TRUST_REGIONS["dppo_sat_tv"].params["sat_quantile"].default
    top = n - 1 - math.floor(q * (n - 1))
    down = (far & ~up).flatten().nonzero()[:, 0]
    assert len(down) >= top
    very = torch.zeros(shift.numel(), dtype=torch.bool)
    very[down[torch.randperm(len(down), generator=torch.Generator().manual_seed(8))[:top]]] = True
    shift = torch.where(very.view_as(shift), -2.0, shift)
    batch.rollout_logp = torch.where(batch.response_mask, (batch.rollout_logp + shift).clamp(max=-1e-3), 0.0)
    batch.rollout_topk_logp = torch.where(far[..., None], batch.rollout_topk_logp - 1.2, batch.rollout_topk_logp)
    rewards = torch.rand(P * G, generator=gen)
    adv = rewards - rewards.view(P, G).mean(-1).repeat_interleave(G)
    # a version lag per token, read by the staleness-adaptive regions (the trainer's `step` sets it from the versions)
    batch.token_staleness = torch.randint(0, 5, batch.response_mask.shape, generator=gen)
    return batch, adv


def _reference(trainer, batch, adv, cell):
    """Gradient and loss of the plain path: reference scoring of the whole batch, then the registered loss."""
    cfg = trainer.cfg
    model = copy.deepcopy(trainer.model)
    if cell["ckpt"]:
        model.gradient_checkpointing_disable()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cell["autocast"] else nullcontext()
    args = (batch.prompt_ids, batch.response_ids, batch.response_mask)
    with autocast:
        with torch.no_grad():
            old = score_responses_reference(model, *args, temperature=cfg.rollout.temperature, topk_ids=batch.rollout_topk_ids)
        scores = score_responses_reference(model, *args, temperature=cfg.rollout.temperature, topk_ids=batch.rollout_topk_ids)
    recompute = cfg.loss.anchor == "recompute"
    region = TRUST_REGIONS[cfg.loss.trust_region]
    divergence = None
    if region.needs_topk and cfg.loss.loss == "masked_is":
        fn = {"topk_tv": topk_tv, "topk_kl": topk_kl}[region.divergence]
        divergence = fn(scores.topk_logp, old.topk_logp if recompute else batch.rollout_topk_logp, batch.rollout_topk_valid)
    inputs = TokenInputs(divergence=divergence, old_logp=old.logp if recompute else None,
                         staleness=batch.token_staleness)  # batch statistics: over this call, the whole batch
    loss, _ = LOSSES[cfg.loss.loss](scores.logp, batch.rollout_logp, adv, batch.response_mask, cfg.loss.spec(), inputs,
                                    max_response_len=cfg.rollout.max_new_tokens)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, float(loss.detach())


def _trainer_grads(trainer, batch, adv):
    """The gradient the trainer's one optimiser step sees, and its step metrics."""
    names = {p: n for n, p in trainer.model.named_parameters()}
    grads, rows = {}, []
    trainer.scorer.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    handle = trainer.optimizer.register_step_pre_hook(
        lambda opt, a, k: grads.update({names[p]: p.grad.clone() for p in trainer.params}))
    old = trainer._recompute(batch) if trainer.cfg.loss.anchor == "recompute" else None
    stats = trainer._update(batch, adv, old)
    handle.remove()
    assert max(rows) <= trainer.cfg.train.micro_batch_size  # the recompute forward is micro-batched too
    return grads, {k: float(v) for k, v in stats.items()}


def test_the_sample_covers_every_pair_and_names_its_cells():
    names = list(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        seen = {(c[a], c[b]) for c in CELLS}
        assert seen == set(itertools.product(OPTIONS[a], OPTIONS[b])), (a, b)
    assert len(CELLS) < 60 and len({_cell_id(c) for c in CELLS}) == len(CELLS)


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
def test_cell_matches_the_reference_gradient_or_is_refused(cell, tmp_path):
    from dppo.train.trainer import Trainer

    field = _refusal(cell)
    if field is not None:
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}:"):
            _config(cell, tmp_path)
        return
    trainer = Trainer(_config(cell, tmp_path), tmp_path)
    try:
        batch, adv = _far_batch(trainer)
        ref_grads, ref_loss = _reference(trainer, batch, adv, cell)
        grads, stats = _trainer_grads(trainer, batch, adv)
    finally:
        trainer.close()
    if cell["loss"] != "drpo" and cell["anchor"] == "rollout" and cell["loss"] != "none":
        assert 0.0 < stats["trust_region/masked_frac"] < 1.0  # the trust region is active on this batch
    assert set(grads) == set(ref_grads) and grads
    if cell["lora"]:
        assert all("lora_" in n for n in grads)
    flat = torch.cat([grads[n].flatten() for n in ref_grads])
    ref = torch.cat([ref_grads[n].flatten() for n in ref_grads])
    assert ref.norm() > 0
    rel = float((flat - ref).norm() / ref.norm())
    bound = 5e-2 if cell["autocast"] else 1e-4
    assert rel < bound, f"relative gradient error {rel:.2e} >= {bound:g}"
    # The loss value sums ±Â·log π terms that largely cancel: under bf16 autocast its log π rounding (~1e-2 per
    # token) leaves an absolute, not a relative, error (measured <= 3e-4 for the masked losses, 1.4e-3 for DRPO,
    # whose r·Â terms carry the rounding through exp).
    assert stats["loss/policy"] == (pytest.approx(ref_loss, abs=2e-3) if cell["autocast"] else pytest.approx(ref_loss, rel=1e-4))


# ------------------------------------------------------------------------------------------------ batch statistics
def _graded_batch(trainer):
    """P·G responses whose µ is moved from π by an amount that grows with the sequence (0.05·(b+1), a random sign
    per token, a small jitter so that no two values tie): the tail of |log π − log µ| over the whole batch (SAT's
    batch statistic) is in the last sequences, while every micro-batch's own tail would be in its own last one."""
    from dppo.train.batch import collate
    from dppo.train.evaluation import engine_prompts

    examples = trainer.train_examples[:P]
    batch = collate(trainer.engine.generate(engine_prompts(examples, trainer.tokenizer), trainer._sampling_params(0)),
                    pad_id=trainer.pad_id)
    gen = torch.Generator().manual_seed(11)
    B, T = batch.response_mask.shape
    size = 0.05 * torch.arange(1, B + 1, dtype=torch.float32)[:, None] + 0.004 * torch.rand(B, T, generator=gen)
    sign = torch.where(torch.rand(B, T, generator=gen) < 0.5, 1.0, -1.0)
    batch.rollout_logp = torch.where(batch.response_mask, (batch.rollout_logp + sign * size).clamp(max=-1e-3), 0.0)
    rewards = torch.rand(P * G, generator=gen)
    adv = rewards - rewards.view(P, G).mean(-1).repeat_interleave(G)
    batch.token_staleness = torch.zeros(B, T, dtype=torch.long)
    return batch, adv


@pytest.mark.parametrize("region", ["dppo_sat_tv", "dppo_sat_kl"])
@pytest.mark.parametrize("micro", [1, 3, P * G])
def test_sat_gradient_does_not_depend_on_the_micro_batch_size(region, micro, tmp_path):
    """SAT's tail quantile is a statistic of the whole optimiser batch (`TrustRegion.batch_stats`): the trainer
    computes it once per mini-batch and passes it to every micro-batch, so the gradient of one optimiser step is the
    whole-batch reference's for every micro-batch size (κ = 0: a token in the tail is masked as soon as π moved with
    its advantage, so a tail taken per micro-batch changes the mask: with the statistic taken per micro-batch, as
    before, micro-batches of 1 and 3 gave relative errors of 4e-2 to 0.12)."""
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"prompts_per_step": P, "group_size": G, "max_new_tokens": 6,
                                          "engine": "hf", "dtype": "float32"},
                       loss={"trust_region": region, "sat_shrink": 0.0}, optim={"grad_clip": 0.0},
                       train={"mini_batches": 1, "micro_batch_size": micro})
    trainer = Trainer(cfg, tmp_path)
    try:
        batch, adv = _graded_batch(trainer)
        ref_grads, ref_loss = _reference(trainer, batch, adv, {"ckpt": False, "autocast": False})
        grads, stats = _trainer_grads(trainer, batch, adv)
    finally:
        trainer.close()
    assert 0.0 < stats["trust_region/masked_frac"] < 1.0
    flat = torch.cat([grads[n].flatten() for n in ref_grads])
    ref = torch.cat([ref_grads[n].flatten() for n in ref_grads])
    rel = float((flat - ref).norm() / ref.norm())
    assert rel < 1e-4, f"relative gradient error {rel:.2e}"  # float32 in another order (module docstring)
    assert stats["loss/policy"] == pytest.approx(ref_loss, rel=1e-4)
