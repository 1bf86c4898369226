"""`DPPOConfig`: TRL's `GRPOConfig` plus DPPO's trust-region fields, resolved and checked by `dppo.loss_spec.loss_spec`
as dppo's own `loss` config section is (so both accept and refuse the same values, and build the same `LossSpec`),
and the map from TRL's `loss_type` to dppo's aggregation modes. Nothing here imports `dppo.train`.

Everything that can be refused before a model loads is refused here, at construction, as a ValueError naming the
field. `check_sampling` (decoding modes whose tokens are not draws from the recorded µ) runs here on
`generation_kwargs` and again in `DPPOTrainer` on the generation config `generate` would use (the model's own
`generation_config` included); `check_server_logprobs` is the one check that needs a running vLLM server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from dppo.loss_spec import LossSpec, loss_spec
from dppo.trust_region import DEFAULT_TOP_K, TRUST_REGIONS, all_params, check_param, needs_topk

__all__ = ["DPPOConfig", "LOSS_TYPE_AGGREGATION", "NOT_SAMPLED", "check_sampling", "check_server_logprobs"]

LOSS_TYPE_AGGREGATION = {
    "dapo": "token-mean",  # denominator: active tokens of the whole generation batch, all processes (TRL's default)
    "bnpo": "token-mean",  # denominator: active tokens of the micro-batch
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",  # each sequence's sum / max_completion_length: the paper's (dppo's default)
}
"""TRL `loss_type` -> dppo aggregation mode. The seq-mean modes leave sequences with no active token out of the
count (docs/library.md, "Decisions where the paper left room"), where TRL counts every row; the two differ only with
`mask_truncated_completions`."""

_DEFAULT = loss_spec()
_REGION_FIELDS = tuple(name for name in all_params() if name not in ("eps_low", "eps_high"))
"""Trust-region parameters that become DPPOConfig fields; the ratio-clip ε are TRL's `epsilon`/`epsilon_high`."""
_EPS_FIELDS = {"eps_low": "epsilon", "eps_high": "epsilon_high"}
_UNSUPPORTED = {  # GRPOConfig field -> (the value DPPO needs, why)
    "vllm_importance_sampling_correction": (False, "DPPO's importance weight π/µ already corrects for the engine "
                                                   "mismatch; TRL's would multiply a second ratio into the loss"),
    "delta": (None, "TRL's two-sided ratio cap; DPPO caps the importance weight with is_cap"),
    "use_transformers_continuous_batching": (False, "that generation path returns no sampling log-probs (µ)"),
}
"""The GRPOConfig fields that are alternatives to DPPO's trust region or importance weight. The features that compose
with a trust region (entropy bonus, entropy filter, off-policy sequence mask) are kept: see DPPOTrainer."""

_BEAMS = ("beam search keeps the best-scoring of several candidate rows and reorders them at every step: its tokens "
          "are not draws from the per-token law the µ recorder sees, and the recorder's rows are beams, not "
          "completions")
_ASSISTED = ("assisted (speculative) decoding drafts tokens with another model or from the prompt and verifies them in "
             "blocks: the logits processors, and so the µ recorder, do not run once per drawn token")
_WARPER = ("a sampling warper that transformers applies after DPPOTrainer's µ recorder, so the recorded law would not "
           "be the sampled one (temperature, top_k, top_p, min_p and the logits processors are recorded)")


def _above(bound: float) -> Callable[[Any], bool]:
    return lambda v: v is not None and not isinstance(v, bool) and v > bound


def _below(bound: float) -> Callable[[Any], bool]:
    return lambda v: v is not None and not isinstance(v, bool) and v < bound


def _given(v: Any) -> bool:
    return v is not None and v is not False


NOT_SAMPLED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "do_sample": (lambda v: v is not None and v is not True,
                  "greedy decoding takes the most likely token: the tokens are not drawn from µ"),
    "temperature": (lambda v: v is not None and v <= 0,
                    "temperature 0 is greedy decoding: µ must be a law sampled from"),
    "num_beams": (_above(1), _BEAMS),
    "num_beam_groups": (_above(1), "diverse beam search: " + _BEAMS),
    "constraints": (_given, "constrained beam search: " + _BEAMS),
    "force_words_ids": (_given, "constrained beam search: " + _BEAMS),
    "use_beam_search": (_given, _BEAMS),
    "best_of": (_above(1), "best-of-n keeps one of several sampled sequences by its score: " + _BEAMS),
    "penalty_alpha": (_above(0), "contrastive search picks tokens by a degeneration penalty, not by drawing from µ"),
    "dola_layers": (_given, "DoLa decoding draws from a contrast of layers' logits, which the recorder does not see"),
    "assistant_model": (_given, _ASSISTED),
    "prompt_lookup_num_tokens": (_given, _ASSISTED),
    "assistant_early_exit": (_given, _ASSISTED),
    "use_mtp": (_given, _ASSISTED),
    "speculation_type": (_given, _ASSISTED),
    "custom_generate": (_given, "a decoding loop loaded from the Hub: what it samples from is unknown"),
    "num_return_sequences": (_above(1), "TRL repeats each prompt num_generations times itself; several sequences per "
                                        "row would not line up with its prompts"),
    "token_healing": (_given, "token healing rewrites the prompt's last tokens, so the completion would not start "
                              "where TRL cuts it from the prompt"),
    "top_h": (_given, _WARPER),
    "typical_p": (_below(1.0), _WARPER),
    "epsilon_cutoff": (_above(0.0), _WARPER),
    "eta_cutoff": (_above(0.0), _WARPER),
    "watermarking_config": (_given, _WARPER),
}
"""Generation settings whose tokens are not draws from the distribution DPPOTrainer records as µ (transformers'
GenerationConfig / generate names, and vLLM's for beam search): name -> (is it switched on?, why)."""

_TRUNCATION = {"top_k": _above(0), "top_p": _below(1.0), "min_p": _given}

REGION_INPUTS = ("staleness",)
"""The per-token inputs of a trust region (`TrustRegion.inputs`) DPPOTrainer provides: staleness = optimiser steps
since the generation batch was sampled (0 for its first step; > 0 for the later steps of `steps_per_generation` >
`gradient_accumulation_steps` or `num_iterations` > 1)."""


def check_sampling(values: Mapping[str, Any] | None, where: str, top_k_logprobs: int = 0) -> None:
    """Refuse decoding that does not sample each token from the recorded µ (`NOT_SAMPLED`), and with top-K capture
    (`top_k_logprobs` > 0) truncated sampling; ValueError naming `<where>.<setting>` (`<setting>` if where is "")."""
    values = values or {}
    prefix = f"{where}." if where else ""
    for name, (switched_on, why) in NOT_SAMPLED.items():
        if name in values and switched_on(values[name]):
            raise ValueError(f"{prefix}{name}: {values[name]!r} is refused by DPPOTrainer: {why}")
    if top_k_logprobs > 0:
        for name, truncates in _TRUNCATION.items():
            if name in values and truncates(values[name]):
                raise ValueError(f"{prefix}{name}: truncated sampling changes µ, so µ's recorded top-K cells would not "
                                 "be those of the sampled distribution; use top_p=1.0, top_k=0, min_p=None with top-K "
                                 f"capture (top_k_logprobs={top_k_logprobs}), got {name}={values[name]!r}")


@dataclass
class _DPPOSettings(GRPOConfig):
    """The DPPO fields of `DPPOConfig` (the trust regions' own parameters are added from the registry below)."""

    trust_region: str = field(default=_DEFAULT.trust_region, metadata={"help": (
        f"A name in dppo.trust_region.TRUST_REGIONS ({', '.join(TRUST_REGIONS)}).")})
    is_cap: float = field(default=_DEFAULT.is_cap, metadata={"help": "C in min(π/µ, C); inf = uncapped."})
    anchor: str = field(default=_DEFAULT.anchor, metadata={"help": (
        "Mask anchor: rollout µ (default, free) or recompute (TRL's π_old; the importance weight stays π/µ).")})
    top_k_logprobs: int | None = field(default=None, metadata={"help": (
        f"K of µ's top-K recorded per token. None = {DEFAULT_TOP_K} when the trust region needs them (Top-K TV/KL), "
        "else 0.")})
    vllm_importance_sampling_correction: bool = field(default=False, metadata={"help": (
        "Must stay False: DPPO's importance weight π/µ is the correction.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dppo(self)

    @property
    def resolved_top_k_logprobs(self) -> int:
        """K of µ's top-K the generation records: top_k_logprobs, or if None 20 for a Top-K region, else 0."""
        if self.top_k_logprobs is not None:
            return self.top_k_logprobs
        return DEFAULT_TOP_K if needs_topk(self.trust_region) else 0

    @property
    def aggregation(self) -> str:
        """dppo's aggregation mode for `loss_type` (`LOSS_TYPE_AGGREGATION`)."""
        return LOSS_TYPE_AGGREGATION[self.loss_type]

    def spec(self) -> LossSpec:
        """The resolved `LossSpec` of DPPOTrainer's loss (`dppo.loss_spec.loss_spec`, as `dppo train` builds its own):
        ratio-clip ε from `epsilon` / `epsilon_high` where the trust region takes ε (GRPOConfig always sets
        `epsilon`, so under another region they are only checked), the aggregation from `loss_type`. ValueError
        naming the field."""
        given = {name: getattr(self, name) for name in _REGION_FIELDS}
        takes = TRUST_REGIONS[self.trust_region].params if self.trust_region in TRUST_REGIONS else {}
        try:
            for eps, name in _EPS_FIELDS.items():
                if eps in takes:
                    given[eps] = getattr(self, name)
                elif getattr(self, name) is not None:
                    check_param(eps, getattr(self, name))
            return loss_spec(trust_region=self.trust_region, anchor=self.anchor, is_cap=self.is_cap,
                             aggregation=self.aggregation, **given)
        except ValueError as exc:  # "eps_low: ..." -> "epsilon: ..."
            name, _, rest = str(exc).partition(":")
            raise ValueError(f"{_EPS_FIELDS.get(name, name)}:{rest}") from None


def _region_field(name: str) -> tuple[str, Any, Any]:
    param = all_params()[name]
    kind = str if isinstance(param.default, str) else float
    return name, kind | None, field(default=None, metadata={"help": param.doc + " None = the region's default."})


DPPOConfig = dataclasses.make_dataclass(
    "DPPOConfig", [_region_field(name) for name in _REGION_FIELDS], bases=(_DPPOSettings,),
    namespace={"__module__": __name__, "__doc__": (
        "`GRPOConfig` plus DPPO's trust region: trust_region, is_cap, anchor, top_k_logprobs and one field per "
        f"trust-region parameter ({', '.join(_REGION_FIELDS)}; None = the region's default), with the defaults and "
        "checks of dppo's own `loss` config. Errors are ValueErrors naming "
        "the field, raised at construction. `loss_type` picks the aggregation (`LOSS_TYPE_AGGREGATION`).")})


SEQUENCE_LEVEL_REGIONS = ("gspo",)
"""The trust regions defined on a sequence ratio: what `importance_sampling_level="sequence"` selects (GSPO)."""


def _sequence_level(cfg) -> None:
    """`importance_sampling_level="sequence"` is GSPO: trust_region 'gspo' (the sequence ratio s = exp(mean log π/µ),
    its clip with TRL's `epsilon` / `epsilon_high`, the weight sg(s)), set when trust_region is left at its default;
    a per-token region with it is refused. trust_region 'gspo' sets the level to "sequence" (TRL's own warnings about
    a token-summed loss_type then apply)."""
    level = cfg.importance_sampling_level
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got {level!r}")
    if level == "sequence" and cfg.trust_region not in SEQUENCE_LEVEL_REGIONS:
        if cfg.trust_region != _DEFAULT.trust_region:
            raise ValueError(f"importance_sampling_level: 'sequence' is GSPO (trust_region='gspo', the sequence ratio "
                             f"and its clip); trust region {cfg.trust_region!r} is per token: leave "
                             f"importance_sampling_level='token' for it")
        cfg.trust_region = "gspo"
    if cfg.trust_region in SEQUENCE_LEVEL_REGIONS:
        cfg.importance_sampling_level = "sequence"


def _check_dppo(cfg) -> None:
    """DPPOConfig's checks; ValueError naming the field."""
    _sequence_level(cfg)
    for name, (needed, why) in _UNSUPPORTED.items():
        if getattr(cfg, name) != needed:
            raise ValueError(f"{name}: DPPOConfig needs {needed!r} ({why}), got {getattr(cfg, name)!r}")
    if cfg.loss_type not in LOSS_TYPE_AGGREGATION:
        raise ValueError(f"loss_type: {cfg.loss_type!r} has no DPPO aggregation; valid: "
                         + ", ".join(f"{k} ({v})" for k, v in LOSS_TYPE_AGGREGATION.items()))
    missing = sorted(set(getattr(TRUST_REGIONS.get(cfg.trust_region), "inputs", ())) - set(REGION_INPUTS))
    if missing:
        raise ValueError(f"trust_region: {cfg.trust_region!r} needs per-token inputs DPPOTrainer does not provide "
                         f"({', '.join(missing)}); use it with `dppo train`")
    spec = cfg.spec()  # the checks of dppo's own `loss` config section, so that both accept and refuse the same values
    if spec.region.batch_stats and cfg.gradient_accumulation_steps != 1:
        raise ValueError(f"gradient_accumulation_steps: trust region {cfg.trust_region!r} reads statistics of the whole "
                         f"optimiser batch ({', '.join(spec.region.batch_stats)}), which DPPOTrainer computes over one "
                         f"micro-batch: set 1 (and raise per_device_train_batch_size), got "
                         f"{cfg.gradient_accumulation_steps}")
    if cfg.top_k_logprobs is not None and not (isinstance(cfg.top_k_logprobs, int) and cfg.top_k_logprobs >= 0):
        raise ValueError(f"top_k_logprobs: expected an int >= 0 or None, got {cfg.top_k_logprobs!r}")
    if not cfg.temperature > 0:
        raise ValueError(f"temperature: expected > 0 (µ is the law sampled at temperature τ; 0 is greedy decoding), "
                         f"got {cfg.temperature!r}")
    k = cfg.resolved_top_k_logprobs
    if needs_topk(cfg.trust_region) and k < 1:
        raise ValueError(f"top_k_logprobs: trust region {cfg.trust_region!r} needs µ's top-K log-probs: set >= 1 "
                         f"(or leave it None for {DEFAULT_TOP_K})")
    check_sampling({name: getattr(cfg, name) for name in _TRUNCATION}, "", k)
    check_sampling(cfg.generation_kwargs, "generation_kwargs", k)
    if not 0.0 <= cfg.top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile: expected a number in [0, 1], got {cfg.top_entropy_quantile!r}")


def check_server_logprobs(server_info: dict) -> None:
    """A vLLM server must return processed log-probs (after temperature: µ), not its default raw ones."""
    mode = server_info.get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        raise ValueError(f"vllm_mode: the vLLM server returns {mode!r} log-probs, which are not those of the sampled "
                         "distribution µ; restart it with `--logprobs-mode processed_logprobs` (trl vllm-serve does)")
