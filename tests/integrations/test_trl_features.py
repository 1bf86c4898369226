"""DPPOTrainer as a drop-in for GRPOTrainer: its signature, µ's alignment invariant and the refusal of decoding that
does not sample from the recorded µ, and GRPOTrainer's terms orthogonal to the trust region (entropy bonus, adaptive
entropy, entropy filter, off-policy sequence mask) composed with every trust region, each checked against TRL's own
computation of the same term on the same tensors: its helpers (`GRPOTrainer.get_off_policy_mask`,
`get_high_entropy_mask`) or GRPOTrainer's `_compute_loss` itself. CPU, tiny in-process models; skipped without TRL.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from dppo.losses import TokenInputs, loss_spec, policy_loss
from dppo.trust_region import TRUST_REGIONS
from test_trl import dataset, integ, make_trainer  # noqa: F401 - fixtures
from test_trl import (LAGS, NON_DEFAULT, REGIONS, grads, group_inputs, needs_trl, plain_scaled_logits, reward_fn,
                                  synthetic_batch)

pytestmark = [needs_trl, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def region_settings(region: str) -> dict:
    """Config overrides for `region`: 4 top-K cells for the Top-K regions, the parameters without a default."""
    required = {name: NON_DEFAULT[name] for name, value in TRUST_REGIONS[region].defaults.items() if value is None}
    return {"trust_region": region, "top_k_logprobs": 4 if TRUST_REGIONS[region].needs_topk else None, **required}


def k_of(region: str) -> int:
    return 4 if TRUST_REGIONS[region].needs_topk else 0


def plain_logp_and_entropy(model, out, temperature):
    """log π at the sampled tokens and the per-token entropy [B, T] from a plain forward (float32)."""
    logp_full = plain_scaled_logits(model, out, temperature).log_softmax(-1)
    logp = logp_full.gather(-1, out["completion_ids"][..., None])[..., 0]
    return logp, logp_full, -(logp_full.exp() * logp_full).sum(-1)


def assert_grads_close(got: dict, want: dict) -> None:
    """Gradients equal up to the rounding of TRL's chunked fused lm-head vs a plain forward (see
    test_integration_trl.test_loss_and_gradient_equal_policy_loss)."""
    assert want.keys() == got.keys() and len(got) > 5
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=max(1e-6, 2e-4 * scale),
                                   msg=lambda m: f"{name} (max |grad| {scale:.3g}): {m}")


# --------------------------------------------------------------------------------------------------- signature
def test_signature_is_grpotrainers():
    """Same parameters as GRPOTrainer.__init__ in the same order, kinds and defaults (read from the installed TRL,
    so a TRL upgrade that changes its signature fails here)."""
    from trl import GRPOTrainer

    from dppo.integrations.trl import DPPOTrainer

    def params(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert params(DPPOTrainer) == params(GRPOTrainer)


def test_positional_arguments_up_to_tools(integ, tokenizer, make_tiny_model, dataset, tmp_path):
    """GRPOTrainer's arguments passed positionally, `tools` and `rollout_func` included, land where GRPOTrainer puts
    them (a TypeError before: `tools` was keyword-only)."""
    config = integ.DPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=4,
                              per_device_train_batch_size=4, max_completion_length=4)
    def rollout(prompts, trainer):
        raise AssertionError("not called")

    trainer = integ.DPPOTrainer(make_tiny_model(seed=0), reward_fn, config, dataset, None, tokenizer, None, None,
                                (None, None), None, None, None, rollout)
    assert trainer.rollout_func is rollout and trainer.processing_class is tokenizer and trainer.tools == []


# --------------------------------------------------------------------------------------------------- µ
def test_beams_and_warpers_of_the_models_generation_config_refused(make_trainer):
    """A model whose own generation_config asks for beams (transformers merges it into TRL's) or an unmodelled warper
    is refused when the trainer is built, naming the setting; before, beams trained on µ of beam rows."""
    for setting, value in (("num_beams", 2), ("typical_p", 0.5), ("num_return_sequences", 2)):
        with pytest.raises(ValueError, match=rf"^model\.generation_config\.{setting}: {value!r} is refused"):
            make_trainer(model_generation_config={setting: value})
    make_trainer(model_generation_config={"repetition_penalty": 1.3})  # a logits processor: recorded, accepted


def test_mu_not_recorded_says_why(make_trainer, dataset):
    """A patched generate that drops the logits processors: the error says µ was not recorded and why (was
    `AttributeError: 'NoneType' object has no attribute 'float'`)."""
    from dppo.integrations.trl.recorder import MuNotRecordedError

    trainer = make_trainer()
    original = trainer.model.generate
    trainer.model.generate = lambda *args, logits_processor=None, **kwargs: original(*args, **kwargs)
    with pytest.raises(MuNotRecordedError, match=r"^µ was not recorded: generate returned \d+ new tokens per row, "
                                                 r"but .* ran at 0 decoding steps\. .*did not run the logits proc"):
        trainer._generate_and_score_completions(group_inputs(dataset))


def test_mu_of_other_rows_refused(make_trainer, dataset):
    """A generate that returns its rows in another order than it sampled them (as beam search reorders beams): µ is
    checked against the completion's own ids and refused."""
    trainer = make_trainer()
    original = trainer.model.generate
    trainer.model.generate = lambda *args, **kwargs: original(*args, **kwargs).flip(0)
    with pytest.raises(RuntimeError, match=r"^µ alignment: the recorder saw \(8, \d+\) tokens .* not the completion's"):
        trainer._generate_and_score_completions(group_inputs(dataset))


@pytest.mark.parametrize("defect", ["short_row", "missing_row"])
def test_mu_alignment_checked_before_the_loss(make_trainer, dataset, defect):
    """A rollout_func whose µ lacks a token's value or a completion's row: refused with the completion named (TRL
    alone pads the row, giving the missing tokens µ = 1)."""
    def rollout(prompts, trainer):
        n = len(prompts)
        logprobs = [[-1.0] * 4 for _ in range(n)]
        if defect == "short_row":
            logprobs[2] = logprobs[2][:3]
        else:
            logprobs = logprobs[:-1]
        return {"prompt_ids": [[5, 6]] * n, "completion_ids": [[7, 8, 9, 1]] * n, "logprobs": logprobs}

    trainer = make_trainer(rollout_func=rollout)
    message = (r"^µ alignment: completion 2 has 4 tokens and 3 values in logprobs" if defect == "short_row" else
               r"^µ alignment: logprobs has 7 rows for 8 completions")
    with pytest.raises(RuntimeError, match=message):
        trainer._generate_and_score_completions(group_inputs(dataset))


# --------------------------------------------------------------------------------------------------- off-policy mask
def test_off_policy_keep_equals_trls_mask():
    """`off_policy_keep` (on `dppo.sequence_mask`) equals GRPOTrainer.get_off_policy_mask on random batches with
    padding, NaN µ (unscorable tokens), advantages of both signs and zero, over thresholds that drop some sequences
    and keep others."""
    from trl import GRPOTrainer

    from dppo.integrations.trl.terms import off_policy_keep

    g = torch.Generator().manual_seed(0)
    dropped = kept = 0
    for _ in range(50):
        B, T = 16, 9
        logp = -torch.rand(B, T, generator=g) * 3
        mu = logp + torch.randn(B, T, generator=g) * 0.5
        mu[torch.rand(B, T, generator=g) < 0.1] = float("nan")
        mask = torch.rand(B, T, generator=g) < 0.8
        mask[0] = False  # a row with no active token
        adv = torch.randn(B, generator=g).round()
        threshold = float(torch.rand((), generator=g) * 0.3 - 0.05)
        want = GRPOTrainer.get_off_policy_mask(adv[:, None], logp, mu, mask.int(), threshold).bool()  # [B, 1]
        got = off_policy_keep(logp, mu, adv, mask, threshold=threshold)
        assert torch.equal(got[mask], want.expand(B, T)[mask])
        dropped += int((~want).sum())
        kept += int((want & (adv[:, None] < 0)).sum())
    assert dropped > 20 and kept > 20  # both outcomes occur for negative advantages


@pytest.mark.parametrize("region", REGIONS)
def test_filter_and_off_policy_mask_match_trl_in_every_region(make_trainer, region):
    """Entropy filter (top_entropy_quantile 0.5) and off-policy mask together with `region`: DPPOTrainer's loss and
    gradient equal Eq. 23 written out by hand with TRL's own masks (`get_high_entropy_mask`,
    `GRPOTrainer.get_off_policy_mask`, on TRL's `_get_per_token_logps_and_entropies`) multiplying the per-token term,
    TRL's normaliser unchanged ("dapo": the batch's tokens), and the trust region's mask computed with the true
    advantages. The threshold lies between the two lowest negative sequences' statistics, so the mask drops some of
    them and keeps one."""
    from trl import GRPOTrainer

    trainer = make_trainer(top_entropy_quantile=0.5, **region_settings(region))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out, _ = synthetic_batch(trainer, K=k_of(region))
    mask, adv, mu = out["completion_mask"].bool(), out["advantages"], out["sampling_per_token_logps"]
    with torch.no_grad():  # TRL's log-probs and entropies of the batch (the fused lm-head DPPOTrainer uses too)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        trl_logp, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, mask.shape[1], compute_entropy=True)
    stat = ((mu - trl_logp) * mask).sum(-1) / mask.sum(-1)
    lowest = stat[adv < 0].sort().values
    trainer.off_policy_mask_threshold = float(lowest[:2].mean())
    entropy_keep = trainer.get_high_entropy_mask(trl_entropy, mask.int(), 0.5)
    sequence_keep = GRPOTrainer.get_off_policy_mask(adv[:, None], trl_logp, mu, mask.int(),
                                                    trainer.off_policy_mask_threshold).bool()  # [B, 1]
    assert (~sequence_keep).sum() == (adv < 0).sum() - 1
    assert 0.3 < entropy_keep[mask].float().mean() < 0.7

    loss = trainer._compute_loss(trainer.model, out)
    loss.backward()
    got = grads(trainer.model)
    trainer.model.zero_grad()
    logp, _, _ = plain_logp_and_entropy(trainer.model, out, trainer.temperature)
    with torch.no_grad():
        if TRUST_REGIONS[region].needs_topk:
            from test_trl import reference_loss

            _, stats = reference_loss(trainer.model, out, region, trainer.temperature, aggregation="token-mean",
                                      **trainer._spec.params)
        else:
            stale = torch.tensor(LAGS, dtype=torch.float32) if TRUST_REGIONS[region].inputs else None
            _, stats = policy_loss(logp, mu, adv, mask, loss_spec(trust_region=region, aggregation="token-mean",
                                                                  **trainer._spec.params), TokenInputs(staleness=stale))
        weight = (logp - mu).clamp(max=20).exp().clamp(max=trainer.args.is_cap)
        if trainer._spec.is_weight == "sequence":  # GSPO: s_u over the response's tokens, whatever the filters keep
            log_s = ((logp - mu) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
            weight = log_s.clamp(max=10).exp().expand_as(logp).clamp(max=trainer.args.is_cap)
        keep = (stats["keep"] & entropy_keep & sequence_keep & mask).float()
    ref = -(keep * weight * adv[:, None] * logp).sum() / out["num_items_in_batch"]
    ref.backward()
    want = grads(trainer.model)
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-7)
    assert_grads_close(got, want)
    logged = trainer._metrics["train"]["dppo/off_policy_masked_frac"][-1]
    assert logged == pytest.approx(((~sequence_keep).expand_as(mask) & mask).sum().item() / mask.sum().item())


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_features_together_match_grpotrainer(make_trainer, loss_type):
    """Entropy filter, off-policy mask and entropy bonus all on, PPO clip with C = ∞ and π_old := µ (where Eq. 23's
    gradient is GRPO's): DPPOTrainer's gradient equals GRPOTrainer's own, per loss_type, with 2 accumulated
    micro-batches; and the bonus makes a difference (the gradient without it differs). The threshold 0.1 drops 2 of
    the 3 sequences with Â < 0 (their mean log µ − log π: 0.29, 0.24, -0.03) and would drop 2 with Â > 0 (0.27, 0.12)
    if the mask were two-sided."""
    from trl import GRPOConfig, GRPOTrainer

    features = dict(top_entropy_quantile=0.6, off_policy_mask_threshold=0.1, entropy_coef=0.05, loss_type=loss_type,
                    epsilon=0.2, epsilon_high=0.28, gradient_accumulation_steps=2, steps_per_generation=4)
    results, batch = [], None
    for trainer_cls, config_cls, extra in ((None, None, {"trust_region": "ppo_clip", "is_cap": math.inf}),
                                           (GRPOTrainer, GRPOConfig, {})):
        trainer = make_trainer(trainer_cls=trainer_cls, config_cls=config_cls, **features, **extra)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
        if batch is None:
            out, _ = synthetic_batch(trainer, K=0, noise=0.5)
            out["old_per_token_logps"] = out["sampling_per_token_logps"]
            batch = out
        trainer._compute_loss(trainer.model, dict(batch)).backward()
        with_bonus = grads(trainer.model)
        trainer.model.zero_grad()
        trainer.entropy_coef = 0.0
        trainer._compute_loss(trainer.model, dict(batch)).backward()
        results.append((with_bonus, grads(trainer.model), trainer._metrics["train"]["policy_loss"]))
        if trainer_cls is None:
            assert trainer._metrics["train"]["dppo/off_policy_masked_frac"][-1] > 0.2
    (dppo_grads, dppo_plain, dppo_logged), (trl_grads, trl_plain, trl_logged) = results
    assert_grads_close(dppo_grads, trl_grads)
    assert_grads_close(dppo_plain, trl_plain)
    assert any(not torch.allclose(dppo_grads[n], dppo_plain[n], rtol=1e-3, atol=1e-6) for n in dppo_grads)
    assert len(dppo_logged) == len(trl_logged) == 2


# --------------------------------------------------------------------------------------------------- entropy bonus
def bonus(trainer, batch, coef: float):
    """(value, gradient) of the entropy bonus in `trainer._compute_loss`: the loss at entropy_coef=coef minus the
    loss at 0, on the same batch and weights."""
    parts = []
    for c in (coef, 0.0):
        trainer.entropy_coef = c
        loss = trainer._compute_loss(trainer.model, dict(batch))
        loss.backward()
        parts.append((loss.detach(), grads(trainer.model)))
        trainer.model.zero_grad()
    (with_bonus, g1), (without, g0) = parts
    return with_bonus - without, {n: g1[n] - g0[n] for n in g1}


@pytest.mark.parametrize("region", REGIONS)
def test_entropy_bonus_equals_grpotrainers_in_every_region(make_trainer, region):
    """The entropy bonus (coef 0.05, over the entropy filter's tokens at quantile 0.5, 2 accumulation steps; 1 for
    the regions that read a statistic of the optimiser batch, which DPPOConfig allows only without accumulation) in
    DPPOTrainer with `region` equals GRPOTrainer's own bonus on the same batch and weights, in value and gradient:
    what the bonus adds to the loss does not depend on the trust region."""
    from trl import GRPOConfig, GRPOTrainer

    accumulation = 1 if TRUST_REGIONS[region].batch_stats else 2
    settings = dict(entropy_coef=0.05, top_entropy_quantile=0.5, gradient_accumulation_steps=accumulation)
    dppo = make_trainer(**settings, **region_settings(region))
    grpo = make_trainer(trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **settings)
    batch, _ = synthetic_batch(dppo, K=k_of(region))
    values = []
    for trainer in (dppo, grpo):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = accumulation
        values.append(bonus(trainer, batch, 0.05))
    (dppo_value, dppo_grad), (grpo_value, grpo_grad) = values
    assert grpo_value < -1e-3  # the bonus lowers the loss by 0.05 x mean entropy / 2
    torch.testing.assert_close(dppo_value, grpo_value, rtol=1e-4, atol=1e-7)
    assert_grads_close(dppo_grad, grpo_grad)


def test_adaptive_entropy_matches_grpotrainer_over_accumulation_windows(make_trainer):
    """use_adaptive_entropy with 2 micro-batches per optimiser step (different batches and token counts), over 3
    windows: the coefficient, the window's entropy, the bonus each micro-batch applies and the logged coefficient are
    GRPOTrainer's. The target is above the entropy, so the coefficient rises every window and is applied from the
    second (the first applies none: no entropy measured yet)."""
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.01, entropy_target=10.0,
                    gradient_accumulation_steps=2)
    trainers = [make_trainer(**settings), make_trainer(trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **settings)]
    batches = [synthetic_batch(trainers[0], K=0, seed=seed)[0] for seed in range(2)]
    batches[1]["completion_mask"][:, 5:] = 0  # fewer tokens in the second micro-batch: the window mean is weighted
    trace = [[], []]
    try:
        run_windows(trainers, batches, trace)
    finally:
        trainers[0].accelerator.gradient_state._set_sync_gradients(True)
    (dppo, grpo) = trace
    assert dppo[0][0] == 0.0 and dppo[-1][0] < -1e-3  # nothing applied before the first measurement, then applied
    assert dppo[-1][1] == pytest.approx(0.02 + 3 * 0.01)
    for got, want in zip(dppo, grpo):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-8)
    assert trainers[0]._metrics["train"]["entropy_coef"] == pytest.approx(trainers[1]._metrics["train"]["entropy_coef"])


def run_windows(trainers, batches, trace, windows: int = 3) -> None:
    """Each trainer through `windows` accumulation windows of `batches` (one micro-batch each, the last one syncing):
    per micro-batch (bonus applied, coefficient after, last window's entropy) appended to its trace."""
    for window in range(windows):
        for micro, batch in enumerate(batches):
            for trainer, out in zip(trainers, trace):
                trainer.model.train()
                trainer.current_gradient_accumulation_steps = 2
                trainer.accelerator.gradient_state._set_sync_gradients(micro == 1)
                trainer._entropy_bonus_enabled = False  # the same micro-batch without the bonus (and no update)
                without = trainer._compute_loss(trainer.model, dict(batch)).detach()
                trainer._entropy_bonus_enabled = True
                applied = trainer._compute_loss(trainer.model, dict(batch)).detach() - without
                out.append((float(applied), trainer.entropy_coef, trainer._last_world_entropy))
