"""dppo.integrations.verl: the losses registered in verl's policy-loss registry, called through verl's own lookup
(`core_algos.get_policy_loss_fn`), equal `dppo.losses.policy_loss` in value and gradient.

verl (0.9.1) is installed without its heavy dependencies (requirements/integrations.txt). It imports ray at import
time only for one annotation (`ray.ObjectRef` in verl.protocol), so when ray is absent verl is imported with a stub
module holding that one name, removed from sys.modules right after; nothing here calls ray. Skipped with the reason
when verl cannot be imported that way either.

Aggregation modes: verl's loss_agg_mode names are dppo's aggregation names (token-mean, seq-mean-token-sum,
seq-mean-token-sum-norm, seq-mean-token-mean). verl's fifth mode, token-sum, maps to dppo's token-mean with
denominator 1. verl's seq-mean-token-mean divides each sequence by (tokens + 1e-8), dppo by max(tokens, 1): equal
in float32 for sequences with a token (1 + 1e-8 rounds to 1); in float64 they differ by 1e-8 relative, inside
assert_close's float64 rtol (1e-7).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import types
from importlib.metadata import entry_points

import pytest
import torch

from dppo.losses import loss_spec, policy_loss

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
LOSSES = {"dppo_binary_tv_mu": "dppo_binary_tv", "dppo_binary_kl_mu": "dppo_binary_kl"}


def _import_core_algos():
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]  # the half-imported package
    stub = types.ModuleType("ray")
    stub.ObjectRef = type("ObjectRef", (), {})
    sys.modules["ray"] = stub
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    finally:
        if sys.modules.get("ray") is stub:
            del sys.modules["ray"]


@pytest.fixture(scope="module")
def verl():
    """(core_algos, dppo.integrations.verl)."""
    try:
        core_algos = _import_core_algos()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        pytest.skip(f"verl is not importable ({type(exc).__name__}: {exc}); see requirements/integrations.txt")
    integration = importlib.import_module("dppo.integrations.verl")
    return core_algos, integration


def _batch(dtype=torch.float32, seed=0, B=6, T=7):
    """Inputs where both trust regions mask some tokens of both advantage signs, with ragged lengths, an empty
    sequence (row 5) and NaN garbage in µ at padding."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[2] = 0.0
    lengths = torch.tensor([7, 5, 3, 6, 1, 0])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    return old.to(dtype), logp.to(dtype), adv.to(dtype), mask


def _verl_call(core_algos, name, old, logp, adv, mask, mode, config=None, weights=None):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode, config=config,
        rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _dppo_call(old, logp, adv, mask, *, denominator=None, max_response_len=None, **settings):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, old, adv, mask, loss_spec(**settings), denominator=denominator,
                                max_response_len=max_response_len)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _actor_config(core_algos, **fields):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, **fields)


def test_registered_through_verls_lookup_and_register_is_idempotent(verl):
    core_algos, integration = verl
    assert set(integration.VERL_LOSSES) == set(LOSSES)
    before = {name: core_algos.get_policy_loss_fn(name) for name in LOSSES}
    assert integration.register() == tuple(LOSSES)
    assert integration.register() == tuple(LOSSES)
    assert {name: core_algos.get_policy_loss_fn(name) for name in LOSSES} == before
    assert before["dppo_binary_tv_mu"] is integration.dppo_binary_tv_mu
    for name in ("dppo_tv", "dppo_kl", "vanilla"):  # verl's own losses are untouched
        assert core_algos.get_policy_loss_fn(name).__module__ == "verl.trainer.ppo.core_algos"


def test_verl_loads_the_losses_itself_through_the_plugin_entry_point(verl):
    """`import verl` loads the "verl.plugins" entry points; dppo's registers the losses in every verl process
    (Ray workers included) with no import on the user's side. Run in a fresh interpreter."""
    plugins = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert plugins.get("dppo") == "dppo.integrations.verl", \
        f"entry point missing ({plugins}): reinstall dppo (scripts/ensure-venv.sh) after a pyproject.toml change"
    code = textwrap.dedent("""
        import importlib.util, sys, types
        if importlib.util.find_spec("ray") is None:  # as _import_core_algos: verl needs ray.ObjectRef at import
            sys.modules["ray"] = types.ModuleType("ray")
            sys.modules["ray"].ObjectRef = type("ObjectRef", (), {})
        from verl.trainer.ppo import core_algos
        assert "dppo.integrations.verl" in sys.modules
        print(sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n.endswith("_mu")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(sorted(LOSSES))


def test_register_refuses_to_replace_a_foreign_loss(verl):
    core_algos, integration = verl
    registry = core_algos.POLICY_LOSS_REGISTRY
    original = registry["dppo_binary_kl_mu"]
    registry["dppo_binary_kl_mu"] = core_algos.compute_policy_loss_vanilla
    try:
        with pytest.raises(ValueError, match="dppo_binary_kl_mu.*already registered"):
            integration.register()
    finally:
        registry["dppo_binary_kl_mu"] = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_equals_policy_loss_in_value_and_gradient(verl, name, mode, dtype):
    """config=None: dppo's defaults (δ 0.15 TV / 0.05 KL, C = 10), local aggregation."""
    core_algos, _ = verl
    old, logp, adv, mask = _batch(dtype)
    loss_v, grad_v, metrics = _verl_call(core_algos, name, old, logp, adv, mask, mode)
    loss_d, grad_d, m = _dppo_call(old, logp, adv, mask, trust_region=LOSSES[name], aggregation=mode)
    torch.testing.assert_close(loss_v, loss_d)
    torch.testing.assert_close(grad_v, grad_d)
    assert 0 < m["masked_frac_pos"] < 1 and 0 < m["masked_frac_neg"] < 1  # both sides of the mask are exercised
    assert grad_v[~mask].abs().max() == 0 and torch.isfinite(grad_v).all()
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], m["masked_frac"])
    torch.testing.assert_close(metrics["actor/dppo/masked_frac_neg"], m["masked_frac_neg"])
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_thresholds_and_cap_come_from_verls_actor_config(verl, name, mode):
    """clip_ratio_low/high -> δ_low/δ_high, clip_ratio_c -> C, as verl's own dppo_tv/dppo_kl read them."""
    core_algos, _ = verl
    old, logp, adv, mask = _batch(seed=1)
    config = _actor_config(core_algos, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=1.5)
    loss_v, grad_v, _ = _verl_call(core_algos, name, old, logp, adv, mask, mode, config=config)
    loss_d, grad_d, m = _dppo_call(old, logp, adv, mask, trust_region=LOSSES[name], aggregation=mode,
                                   delta_low=0.1, delta_high=0.3, is_cap=1.5)
    torch.testing.assert_close(loss_v, loss_d)
    torch.testing.assert_close(grad_v, grad_d)
    assert m["ratio_above_cap_frac"] > 0  # the cap binds somewhere
    _, grad_default, _ = _dppo_call(old, logp, adv, mask, trust_region=LOSSES[name], aggregation=mode)
    assert not torch.allclose(grad_v, grad_default)  # the config did change the loss


def test_invalid_config_value_names_verls_field(verl):
    core_algos, _ = verl
    old, logp, adv, mask = _batch()
    with pytest.raises(ValueError, match="clip_ratio_high"):
        _verl_call(core_algos, "dppo_binary_tv_mu", old, logp, adv, mask, "token-mean",
                   config=_actor_config(core_algos, clip_ratio_high=-0.1))
    with pytest.raises(ValueError, match="loss_agg_mode.*valid"):
        _verl_call(core_algos, "dppo_binary_tv_mu", old, logp, adv, mask, "seq-sum")


@pytest.mark.parametrize("mode", (*MODES, "token-sum"))
def test_global_batch_info_matches_verls_agg_loss(verl, mode):
    """With verl's global batch info (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) the value is
    verl's `agg_loss` of dppo's per-token loss −keep·sg(min(r, C))·Â·log π, and the micro-batches of a mini-batch
    sum to the whole (here: two micro-batches, dp_size 2)."""
    core_algos, _ = verl
    old, logp, adv, mask = _batch(seed=2)
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()) + 9, "global_batch_size": 11, "loss_scale_factor": 16}
    config = _actor_config(core_algos, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=10.0)
    config.global_batch_info.update(info)
    parts = []
    for rows in (slice(0, 3), slice(3, 6)):
        loss_v, grad_v, _ = _verl_call(core_algos, "dppo_binary_tv_mu", old[rows], logp[rows], adv[rows], mask[rows],
                                       mode, config=config)
        # the reference: dppo's mask (returned as `keep`), verl's aggregation
        _, _, m = _dppo_call(old[rows], logp[rows], adv[rows], mask[rows], trust_region="dppo_binary_tv")
        lp = logp[rows].clone().requires_grad_(True)
        ratio = torch.exp(lp.detach() - old[rows]).clamp(max=10.0)
        coef = torch.where(mask[rows], m["keep"].float() * ratio * adv[rows], torch.zeros_like(lp))  # NaN µ at padding
        loss_mat = -coef * lp
        expected = core_algos.agg_loss(loss_mat, mask[rows].float(), mode, **info)
        expected.backward()
        torch.testing.assert_close(loss_v, expected.detach())
        torch.testing.assert_close(grad_v, lp.grad)
        parts.append(loss_v)
    if mode != "token-sum":  # the two micro-batches add up to dppo's loss of the whole batch, times dp_size
        denominator = info["batch_num_tokens"] if mode == "token-mean" else info["global_batch_size"]
        whole, _, _ = _dppo_call(old, logp, adv, mask, trust_region="dppo_binary_tv", aggregation=mode,
                                 denominator=denominator, max_response_len=info["loss_scale_factor"])
        torch.testing.assert_close(parts[0] + parts[1], 2 * whole)


@pytest.mark.parametrize("mode", MODES)
def test_rollout_is_weights_multiply_each_token(verl, mode):
    """Decoupled mode: verl's rollout_is_weights (its truncated π_old/µ) multiply each token's term, as in verl's
    own losses; the same as dppo's loss with Â·w, since w > 0 keeps Â's sign (and so the mask)."""
    core_algos, _ = verl
    old, logp, adv, mask = _batch(seed=3)
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(4)) * 1.5 + 0.25
    loss_v, grad_v, _ = _verl_call(core_algos, "dppo_binary_kl_mu", old, logp, adv, mask, mode, weights=w)
    loss_d, grad_d, _ = _dppo_call(old, logp, adv * w, mask, trust_region="dppo_binary_kl", aggregation=mode)
    torch.testing.assert_close(loss_v, loss_d)
    torch.testing.assert_close(grad_v, grad_d)
    loss_plain, _, _ = _verl_call(core_algos, "dppo_binary_kl_mu", old, logp, adv, mask, mode)
    assert not torch.allclose(loss_v, loss_plain)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,verl_name,delta", [("dppo_binary_tv_mu", "dppo_tv", 0.15), ("dppo_binary_kl_mu", "dppo_kl", 0.05)])
def test_matches_verls_own_dppo_losses(verl, name, verl_name, delta, mode):
    """verl's `dppo_tv`/`dppo_kl` (mask against old_log_prob, ratio truncated at clip_ratio_c) are the same objectives:
    with the same thresholds and cap, and µ away from the clamp verl applies at |log r| = 20 and from its 1e-8 in
    the Binary KL, values and gradients agree. (verl's pg_clipfrac also counts tokens with Â = 0 that moved down by
    more than δ_low, whose term is zero anyway; dppo never masks them: so Â ≠ 0 everywhere here.)"""
    core_algos, _ = verl
    old, logp, adv, mask = _batch(seed=5)
    old = torch.where(mask, old, torch.zeros_like(old))  # verl's own losses would carry NaN from padding into the sum
    adv = torch.where(adv == 0, torch.full_like(adv, 0.5), adv)
    config = _actor_config(core_algos, clip_ratio=delta, clip_ratio_low=delta, clip_ratio_high=delta, clip_ratio_c=10.0)
    ours = _verl_call(core_algos, name, old, logp, adv, mask, mode, config=config)
    theirs = _verl_call(core_algos, verl_name, old, logp, adv, mask, mode, config=config)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    assert 0 < ours[2]["actor/pg_clipfrac"] < 1
    torch.testing.assert_close(ours[2]["actor/pg_clipfrac"], torch.tensor(theirs[2]["actor/pg_clipfrac"]))
    torch.testing.assert_close(ours[2]["actor/ppo_kl"], torch.tensor(theirs[2]["actor/ppo_kl"]))
