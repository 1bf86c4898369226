"""fp8 rollouts (`rollout.quantization fp8`, `dppo.rollout.quantize`) and the stale engine (`rollout.engine_lag`)."""

from __future__ import annotations

import copy

import pytest
import torch

from dppo.divergence import full_tv
from dppo.rollout import SamplingParams
from dppo.rollout.hf import HFEngine
from dppo.rollout.quantize import FP8_MAX, QuantizedEngine, add_fp8_activation_hooks, fp8_rows, fp8_weights, quantizes
from dppo.train.batch import collate
from dppo.train.config import ConfigError, replace
from dppo.train.presets import get_preset
from dppo.train.scoring import score_responses_reference
from conftest import smoke_config

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3 = E4M3[torch.isfinite(E4M3)].unique()  # every finite e4m3 value, sorted


def _nearest_e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """Slow reference: the representable e4m3 value nearest to each element (|x| <= 448)."""
    return E4M3[(x[..., None] - E4M3).abs().argmin(-1)]


def test_fp8_rows_is_the_nearest_e4m3_value_per_row_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=gen) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0, 1e4])[:, None]
    got = fp8_rows(x)
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    scaled = (x / scale).double()
    ref_q = _nearest_e4m3_reference(x / scale).double()
    # the nearest value, up to ties (both neighbours equally near): compare the distances, not the values; 5e-4 in
    # scaled units is float32 rounding of x / s (values up to 448), a quarter of e4m3's smallest spacing (2^-9)
    assert torch.allclose((got.double() / scale.double() - scaled).abs(), (ref_q - scaled).abs(), rtol=0, atol=5e-4)
    assert torch.equal(got.abs().amax(-1), x.abs().amax(-1))  # the row's largest element maps to 448 exactly
    assert (got - x).abs().max() > 0 and ((got - x).abs() / x.abs().amax(-1, keepdim=True)).max() < 2 ** -4
    assert torch.equal(fp8_rows(torch.zeros(2, 3)), torch.zeros(2, 3))  # an all-zero row stays zero (no 0/0)


def test_only_decoder_linear_weights_are_quantised(tiny_model):
    state = tiny_model.state_dict()
    q = fp8_weights(state)
    changed = {n for n in state if not torch.equal(state[n], q[n])}
    assert changed and changed == {n for n, v in state.items() if quantizes(n, v)}
    assert all("proj" in n for n in changed) and not any("embed" in n or "norm" in n for n in changed)


def _quantised_copy(model, *, activations=False):
    ref = copy.deepcopy(model)
    ref.load_state_dict(fp8_weights(model.state_dict()))
    if activations:
        add_fp8_activation_hooks(ref)
    return ref


@pytest.mark.parametrize("activations", [False, True])
def test_recorded_mu_is_the_quantised_models_distribution(tiny_model, tokenizer, chat_prompts, activations):
    engine = QuantizedEngine(HFEngine(copy.deepcopy(tiny_model), tokenizer, seed=0), activations=activations)
    engine.load_weights(tiny_model)
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=10, seed=1)
    batch = collate(engine.generate(chat_prompts, params), pad_id=0)
    args = (batch.prompt_ids, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        quantised = score_responses_reference(_quantised_copy(tiny_model, activations=activations), *args, temperature=0.8)
        plain = score_responses_reference(tiny_model, *args, temperature=0.8)
    mask = batch.response_mask
    torch.testing.assert_close(batch.rollout_logp[mask], quantised.logp[mask], rtol=0, atol=1e-5)
    assert (batch.rollout_logp - plain.logp)[mask].abs().max() > 1e-3  # and it is not the unquantised model's


def test_fp8_mismatch_grows_with_the_logits_scale(make_tiny_model):
    """Logits scaled up (the final norm's weight times c, as a sharpening policy does): the exact TV between the
    fp8 and the full-precision next-token distributions grows with c."""
    ids = torch.randint(2, 100, (8, 24), generator=torch.Generator().manual_seed(0))
    tvs = []
    for c in (1.0, 4.0, 16.0):
        model = make_tiny_model(seed=1).eval()
        with torch.no_grad():
            model.model.norm.weight.mul_(c)
            logp = model(input_ids=ids).logits.float().log_softmax(-1)
            q_logp = _quantised_copy(model)(input_ids=ids).logits.float().log_softmax(-1)
        tvs.append(float(full_tv(q_logp, logp).mean()))
    assert tvs[0] < tvs[1] < tvs[2], tvs  # measured: 0.077, 0.149, 0.171
    assert tvs[2] > 1.5 * tvs[0]


def test_config_checks():
    with pytest.raises(ConfigError, match=r"^rollout\.hf\.fp8_activations: needs an hf engine with fp8 weights"):
        replace(get_preset("smoke"), rollout={"hf": {"fp8_activations": True}})
    with pytest.raises(ConfigError, match=r"^rollout\.engine_lag: expected >= 0"):
        replace(get_preset("smoke"), rollout={"engine_lag": -1})


def _trainer(tmp_path, **rollout):
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout=rollout)
    return Trainer(cfg, tmp_path)


def test_trainer_with_fp8_rollouts_records_the_quantised_mu(tmp_path):
    trainer = _trainer(tmp_path, quantization="fp8")
    try:
        assert isinstance(trainer.engine, QuantizedEngine)
        metrics = trainer.step()
        # fp8 engine vs fp32 trainer: a real mismatch (measured 4e-5 on this near-uniform model; a float32 engine: 1.5e-9)
        assert metrics["mismatch/binary_tv_mean"] > 1e-5
        engine_w = dict(trainer.engine.model.named_parameters())
        for name, w in trainer.model.named_parameters():  # the engine holds the quantised current weights
            expected = fp8_rows(w.detach()) if quantizes(name, w) else w.detach()
            torch.testing.assert_close(engine_w[name], expected, rtol=0, atol=0)
    finally:
        trainer.close()


def test_engine_lag_samples_with_the_weights_of_k_steps_ago(tmp_path):
    trainer = _trainer(tmp_path, engine_lag=1)
    try:
        snapshots = [{n: p.detach().clone() for n, p in trainer.model.named_parameters()}]
        staleness = []
        for _ in range(3):
            staleness.append(trainer.step()["rollout/staleness_max"])
            snapshots.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            engine_w = dict(trainer.engine.model.named_parameters())
            lagged = snapshots[max(0, len(snapshots) - 2)]  # the weights of one optimiser step ago
            for name in lagged:
                torch.testing.assert_close(engine_w[name], lagged[name], rtol=0, atol=0)
            assert any(not torch.equal(engine_w[n], snapshots[-1][n]) for n in lagged)  # not the current weights
        assert staleness == [0.0, 1.0, 1.0]
    finally:
        trainer.close()
