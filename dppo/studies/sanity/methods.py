"""The study's methods and mismatch sources: what `--methods` and `--mismatch` accept, and what each one sets.

A method is a preset name of `dppo.train.presets` (`SANITY_METHODS`), optionally with loss-field overrides, e.g.
`dppo-binary-tv:delta=0.1` (`delta` sets δ_low and δ_high, `eps` sets ε_low and ε_high, any other `LossConfig`
field by name), or a group name from `METHOD_GROUPS` (all = the 9 methods of Fig. 3; key = the 6 of the mismatch
study; relax = the relax-α ablation of §6 beside its base; delta = the δ sweep of F.4; fig5 = PG-IS with only the
negative-sample mask, §5.3; stale = the trust regions for stale data beside five baselines; baselines = IcePop, GSPO,
the geometric mask and decoupled TIS beside the same five). All methods get the same lr, batch and steps; only the `loss` section differs, taken
from the method presets.

A mismatch source (`parse_mismatch`) sets the rollout side of a study: none (the no-mismatch control), bf16, fp8,
lag:K or noise:SIGMA (`dppo.studies.sanity.noise`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from dppo.train.config import ConfigError, LossConfig
from dppo.train.presets import PRESETS

SANITY_METHOD_NAMES = ("pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl",
                       "dppo-topk-tv", "dppo-topk-kl", "dppo-recompute")
"""The default method list (Fig. 3's methods)."""
RELAX_METHOD_NAMES = ("grpo-relax-high", "grpo-relax-low", "grpo-relax-both")
"""The relax-α ablation (§6): run on request (`--methods relax`)."""
FIG5_METHOD_NAMES = ("pg-is-neg-mask",)
STALE_METHOD_NAMES = ("dppo-stale-tv", "dppo-sat-tv", "dppo-seq-max", "dppo-seq-k3")
"""The trust regions for stale data (`--methods stale`, beside the baselines): staleness-adaptive δ(τ), the SAT-like
tail contraction, and DPPO-Binary-TV with a sequence mask (largest token TV; mean k3)."""
"""Fig. 5 (§5.3): PG-IS with only the negative-sample mask (`--methods fig5`: δ 0.5 and 0.8, at µ and at π_old)."""
BASELINE_METHOD_NAMES = ("icepop", "gspo", "geo-mask", "tis")
"""The field's mismatch corrections (`--methods baselines`, beside DPPO-Binary-TV/KL and the paper's baselines): token
MIS / IcePop, GSPO, the geometric sequence mask, decoupled token TIS."""
METHOD_GROUPS: dict[str, tuple[str, ...]] = {
    "all": SANITY_METHOD_NAMES,
    "key": ("pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl"),
    "relax": ("grpo-clip-higher",) + RELAX_METHOD_NAMES,
    "delta": ("dppo-binary-tv:delta=0.1", "dppo-binary-tv", "dppo-binary-tv:delta=0.2",
              "dppo-binary-kl", "dppo-binary-kl:delta=0.1", "dppo-binary-kl:delta=0.15"),
    "stale": ("pg-is", "cispo", "minirl", "dppo-binary-tv", "dppo-binary-kl") + STALE_METHOD_NAMES,
    "baselines": ("pg-is", "cispo", "minirl", "dppo-binary-tv", "dppo-binary-kl") + BASELINE_METHOD_NAMES,
    "fig5": ("pg-is", "pg-is-neg-mask", "pg-is-neg-mask:neg_delta=0.8", "pg-is-neg-mask:anchor=recompute",
             "pg-is-neg-mask:neg_delta=0.8:anchor=recompute"),
}
"""Names usable in `--methods` for a list of methods."""


def _loss_overrides(preset: str) -> dict[str, Any]:
    """The loss section of a method preset: trust region, anchor and IS cap always, plus every field that
    differs from `LossConfig`'s defaults."""
    loss = PRESETS[preset][0]().loss
    default = LossConfig()
    out = {"trust_region": loss.trust_region, "anchor": loss.anchor, "is_cap": loss.is_cap}
    for f in dataclasses.fields(LossConfig):
        value = getattr(loss, f.name)
        if value != getattr(default, f.name):
            out[f.name] = value
    return out


SANITY_METHODS: dict[str, dict[str, Any]] = {name: _loss_overrides(name)
                                             for name in SANITY_METHOD_NAMES + RELAX_METHOD_NAMES + FIG5_METHOD_NAMES
                                             + STALE_METHOD_NAMES + BASELINE_METHOD_NAMES}
"""Method name -> `loss` section overrides (from `dppo.train.presets`). Top-K methods record µ's top-20 (the registry's
`needs_topk`, resolved by `Config.top_k_logprobs`)."""

_SHORTHANDS = {"delta": ("delta_low", "delta_high"), "eps": ("eps_low", "eps_high")}


def method_loss(method: str) -> dict[str, Any]:
    """The `loss` section of a method spec `NAME[:field=value...]`: the preset's overrides, then the given fields
    (`delta` = both δ, `eps` = both ε). ValueError naming the method for an unknown name, field or bad value."""
    name, *pairs = method.split(":")
    if name not in SANITY_METHODS:
        raise ValueError(f"method: unknown {name!r}; valid: {', '.join(SANITY_METHODS)} (or a group: "
                         f"{', '.join(METHOD_GROUPS)})")
    loss = dict(SANITY_METHODS[name])
    fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        targets = _SHORTHANDS.get(key, (key,))
        if not sep or any(t not in fields for t in targets):
            raise ValueError(f"method {method!r}: expected field=value with a loss field or delta/eps, got {pair!r}")
        try:
            value: Any = float(text)
        except ValueError:
            value = text
        for t in targets:
            loss[t] = value
    try:
        LossConfig(**loss)
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"method {method!r}: {exc}") from None
    return loss


def expand_methods(names: Sequence[str]) -> list[str]:
    """Group names replaced by their methods (order kept, duplicates dropped); each spec checked by `method_loss`."""
    out: list[str] = []
    for name in names:
        for m in METHOD_GROUPS.get(name, (name,)):
            method_loss(m)
            if m not in out:
                out.append(m)
    return out


def run_name(method: str) -> str:
    """The run folder's name stem of a method spec (`dppo-binary-tv:delta=0.1` -> `dppo-binary-tv_delta0.1`)."""
    return method.replace(":", "_").replace("=", "")


MISMATCH_SOURCES = ("none", "bf16", "fp8", "lag:K", "noise:SIGMA")


def parse_mismatch(spec: str) -> dict[str, Any]:
    """The rollout-side mismatch of `--mismatch SPEC` as settings: none (float32 engine, the control), bf16 (a
    bf16 engine), fp8 (fp8 weights, `rollout.quantization`), lag:K (the engine K optimiser steps behind,
    `rollout.engine_lag`), noise:SIGMA (N(0, σ²) logit noise). ValueError naming `--mismatch` otherwise."""
    kind, _, arg = spec.partition(":")
    out = {"engine_dtype": "float32", "logit_noise": 0.0, "quantization": "none", "engine_lag": 0}
    try:
        if kind in ("none", "bf16", "fp8") and not arg:
            out.update({"bf16": {"engine_dtype": "bfloat16"}, "fp8": {"quantization": "fp8"}}.get(kind, {}))
            return out
        if kind == "lag" and int(arg) >= 1:
            return {**out, "engine_lag": int(arg)}
        if kind == "noise" and 0 < float(arg) < math.inf:
            return {**out, "logit_noise": float(arg)}
    except ValueError:
        pass
    raise ValueError(f"--mismatch: expected one of {', '.join(MISMATCH_SOURCES)} (K >= 1, SIGMA > 0), got {spec!r}")
