"""DPPO's Binary trust regions as verl policy losses (verl 0.9.1), computed by `dppo.losses.policy_loss`.

Importing this module registers, in verl's policy-loss registry (`verl.trainer.ppo.core_algos`):

    dppo_binary_tv_mu   Binary-TV mask (Eq. 13), IS weight sg(min(π/µ, C))   (dppo's `dppo_binary_tv`)
    dppo_binary_kl_mu   Binary-KL mask (Eq. 14), IS weight sg(min(π/µ, C))   (dppo's `dppo_binary_kl`)

so that `actor_rollout_ref.actor.policy_loss.loss_mode=dppo_binary_tv_mu` selects one. verl finds the module in its
worker processes through the `verl.plugins` entry point dppo declares (pyproject.toml), or through
VERL_USE_EXTERNAL_MODULES=dppo.integrations.verl.

What verl passes, and what these losses make of it (verl's signature: old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights; all [B, T]):
- µ is `old_log_prob`. "_mu" names the intended anchor: with verl's V1 trainer (`trainer.use_v1=True`, the 0.9.1
  default), `algorithm.rollout_correction.bypass_mode=True` and `actor_rollout_ref.rollout.calculate_log_probs=True`,
  verl puts the engine's `rollout_log_probs` (vLLM's processed log-probs, i.e. at the sampling temperature: verl's
  default `rollout.logprobs_mode`) in `old_log_prob` and skips the recompute forward. Then the mask is anchored at
  µ and the importance weight is min(π/µ, C): dppo's default (`anchor="rollout"`), exactly.
  In decoupled mode (bypass_mode=False) `old_log_prob` is the recomputed π_old: mask and weight are then anchored
  at π_old (dppo's `anchor="recompute"` mask, but with weight min(π/π_old, C)); if `rollout_correction.rollout_is`
  is set, verl's `rollout_is_weights` (its truncated π_old/µ) multiply each token's term, as in verl's own losses
  (done here by scaling the advantage, which keeps its sign). Without them µ is not seen at all.
  The legacy trainer (`trainer.use_v1=False`) replaces loss_mode by its own "bypass_mode" loss when bypass_mode is
  on, so there only decoupled mode can select these losses.
- Thresholds and cap come from the actor config, as for verl's own `dppo_tv`/`dppo_kl`: δ_low = clip_ratio_low,
  δ_high = clip_ratio_high (each falling back to clip_ratio), C = clip_ratio_c. verl's defaults (0.2, 0.2, 3.0) are
  not dppo's: set clip_ratio_low = clip_ratio_high = 0.15 (TV) or 0.05 (KL), and clip_ratio_c = 10. With
  config=None (a direct call) dppo's own defaults apply. Values are checked by `dppo.loss_spec.loss_spec`.
- `loss_agg_mode` maps to dppo's aggregation of the same name; verl's `global_batch_info` (dp_size,
  batch_num_tokens, global_batch_size, loss_scale_factor) becomes dppo's `denominator`/`max_response_len` and a
  final ×dp_size, so the value equals verl's `agg_loss` of the same per-token loss:
      token-mean               token-mean, denominator = batch_num_tokens (None: this micro-batch's tokens)
      seq-mean-token-sum       same name, denominator = global_batch_size (None: this micro-batch's sequences)
      seq-mean-token-sum-norm  same name, denominator = global_batch_size, max_response_len = loss_scale_factor
      seq-mean-token-mean      same name, denominator = global_batch_size (verl divides each sequence by its
                               token count + 1e-8, dppo by max(count, 1): equal in float32 for any count >= 1)
      token-sum                token-mean with denominator 1 (verl's fifth mode: the plain token sum)
- Metrics: verl's `actor/pg_clipfrac` (masked fraction) and `actor/ppo_kl`, plus dppo's masked fractions by
  advantage sign and ratio statistics under `actor/dppo/` (detached scalar tensors; verl's Metric takes them).

Top-K (dppo_topk_tv / dppo_topk_kl) is not registered: its divergence needs µ's top-K log-probs at every
position, and stock verl records only the sampled token's log-prob (`rollout_log_probs`). With a rollout that
recorded them, compute `dppo.divergence.topk_tv`/`topk_kl` and call `dppo.losses.policy_loss` with
`TokenInputs(divergence=...)`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor

from dppo.loss_spec import LossSpec, loss_spec
from dppo.losses import policy_loss

try:
    from verl.trainer.ppo import core_algos
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dppo.integrations.verl needs verl 0.9.1 (`pip install --no-deps verl==0.9.1` beside "
                      f"`pip install 'dppo[verl]'`: requirements/integrations.txt); import failed: {exc}") from exc

__all__ = ["VERL_LOSSES", "AGG_MODES", "register", "dppo_binary_tv_mu", "dppo_binary_kl_mu"]

VERL_LOSSES: dict[str, str] = {
    "dppo_binary_tv_mu": "dppo_binary_tv",
    "dppo_binary_kl_mu": "dppo_binary_kl",
}
"""verl loss_mode name -> dppo trust region."""

AGG_MODES: dict[str, str] = {
    "token-mean": "token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "token-sum": "token-mean",  # with denominator 1
}
"""verl loss_agg_mode -> dppo aggregation (module docstring: how the denominators map)."""

_CONFIG_FIELDS = {"delta_low": ("clip_ratio_low", "clip_ratio"), "delta_high": ("clip_ratio_high", "clip_ratio"),
                  "is_cap": ("clip_ratio_c",)}
"""dppo parameter -> the verl actor-config fields it is read from, first set one wins."""


def _get(config: Any, name: str) -> Any:
    """config[name] for verl's ActorConfig / DictConfig / dict, None when absent."""
    if config is None:
        return None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        try:
            return config.get(name, None)
        except Exception:  # a structured config without the key
            return None
    return getattr(config, name, None)


def _spec(trust_region: str, aggregation: str, config: Any) -> LossSpec:
    """The `LossSpec` of `trust_region` with delta_low, delta_high, is_cap from verl's config (absent = dppo's
    default), resolved and checked by `dppo.loss_spec.loss_spec`; an error names verl's field."""
    given: dict[str, float] = {}
    source: dict[str, str] = {}
    for param, fields in _CONFIG_FIELDS.items():
        found = next(((f, _get(config, f)) for f in fields if _get(config, f) is not None), None)
        if found is not None:
            source[param], given[param] = found[0], float(found[1])
    try:
        return _cached_spec(trust_region, aggregation, tuple(sorted(given.items())))
    except ValueError as exc:  # "delta_high: expected > 0, got -1.0" -> "clip_ratio_high: delta_high of ...; ..."
        param, _, rest = str(exc).partition(": ")
        if param not in source:
            raise
        raise ValueError(f"{source[param]}: {param} of {trust_region}; {rest}") from None


@functools.lru_cache(maxsize=64)
def _cached_spec(trust_region: str, aggregation: str, given: tuple[tuple[str, float], ...]) -> LossSpec:
    """`loss_spec` once per distinct setting (verl calls the loss once per micro-batch)."""
    return loss_spec(trust_region=trust_region, aggregation=aggregation, **dict(given))


def _aggregation(loss_agg_mode: str, batch: Mapping[str, Any]) -> tuple[str, Any, Any]:
    """(dppo aggregation, denominator, max_response_len) for verl's loss_agg_mode and global_batch_info."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown {loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}")
    dp_size = batch.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return "token-mean", 1.0, None
    if loss_agg_mode == "token-mean":
        denominator = batch.get("batch_num_tokens")
        if denominator is None and dp_size > 1:
            raise ValueError("global_batch_info: batch_num_tokens is required when dp_size > 1 (as verl's agg_loss)")
        return "token-mean", denominator, None
    denominator = batch.get("global_batch_size")
    if denominator is None and dp_size > 1:
        raise ValueError("global_batch_info: global_batch_size is required when dp_size > 1 (as verl's agg_loss)")
    max_len = batch.get("loss_scale_factor") if loss_agg_mode == "seq-mean-token-sum-norm" else None
    return AGG_MODES[loss_agg_mode], denominator, max_len


def verl_policy_loss(
    trust_region: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`dppo.losses.policy_loss` with `trust_region` under verl's policy-loss signature (module docstring).

    old_log_prob: [B, T] µ (bypass mode) or π_old; log_prob: [B, T] π with gradient; advantages: [B, T];
    response_mask: [B, T] (bool or 0/1); rollout_is_weights: [B, T] or None. Returns (scalar loss, metrics).
    """
    batch = dict(_get(config, "global_batch_info") or {})
    aggregation, denominator, max_len = _aggregation(loss_agg_mode, batch)
    mask = response_mask.bool()
    adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights.detach()
    loss, m = policy_loss(log_prob, old_log_prob, adv, mask, _spec(trust_region, aggregation, config),
                          denominator=denominator, max_response_len=max_len)
    dp_size = batch.get("dp_size") or 1
    if isinstance(dp_size, Tensor) or dp_size != 1:
        loss = loss * dp_size
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        log_ratio = (log_prob.detach() - old_log_prob.detach()).float().clamp(-20.0, 20.0)
        ppo_kl = torch.where(mask, -log_ratio, torch.zeros_like(log_ratio)).sum() / n
    metrics = {"actor/pg_clipfrac": m["masked_frac"], "actor/ppo_kl": ppo_kl}
    for key in ("masked_frac_pos", "masked_frac_neg", "ratio_mean", "ratio_max", "ratio_above_cap_frac"):
        metrics[f"actor/dppo/{key}"] = m[key]
    return loss, metrics


def _make(name: str, trust_region: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    def loss_fn(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        return verl_policy_loss(trust_region, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                config, rollout_is_weights)

    loss_fn.__name__ = loss_fn.__qualname__ = name
    loss_fn.__module__ = __name__
    loss_fn.__doc__ = (f"verl policy loss {name!r}: dppo's {trust_region} trust region, IS weight min(π/µ, C), "
                       "µ = old_log_prob (dppo.integrations.verl).")
    return loss_fn


dppo_binary_tv_mu = _make("dppo_binary_tv_mu", "dppo_binary_tv")
dppo_binary_kl_mu = _make("dppo_binary_kl_mu", "dppo_binary_kl")
_LOSS_FNS = {"dppo_binary_tv_mu": dppo_binary_tv_mu, "dppo_binary_kl_mu": dppo_binary_kl_mu}


def register() -> tuple[str, ...]:
    """Register the losses of `VERL_LOSSES` with verl (idempotent; done on import). Returns their names.
    A different function already registered under one of these names is an error (never silently replaced)."""
    registry = core_algos.POLICY_LOSS_REGISTRY
    for name, fn in _LOSS_FNS.items():
        present = registry.get(name)
        if present is not None and present is not fn and getattr(present, "__module__", None) != __name__:
            owner = f"{present.__module__}.{present.__qualname__}"
            raise ValueError(f"verl policy loss {name!r} is already registered by {owner}")
        if present is not fn:
            core_algos.register_policy_loss(name)(fn)
    return tuple(_LOSS_FNS)


register()
