"""DPPO inside Hugging Face TRL (1.16): `DPPOConfig` / `DPPOTrainer`, drop-ins for `GRPOConfig` / `GRPOTrainer`,
and `dppo_rollout_func`, a TRL `rollout_func` on dppo's engines that records µ's top-K (Top-K TV/KL).

A GRPO script becomes DPPO by changing the config and trainer classes (docs/integrations.md shows the diff). The
loss is `dppo.losses.policy_loss` (Eq. 23: −keep·sg(min(π/µ, C))·Â·log π) on TRL's per-token tensors, so every
trust region of `dppo.trust_region.TRUST_REGIONS` runs inside TRL with the defaults and checks of dppo's own config.

Where µ (the rollout policy, the anchor of the trust region and the denominator of the importance weight) comes
from; never from a recomputed forward (TRL's `old_per_token_logps` only moves the *mask* with anchor="recompute"):
- transformers generation (TRL's default path, replaced here): the log-softmax of the final scores each token was
  drawn from, i.e. after temperature, top-k/top-p/min-p and the other logits processors, recorded during `generate`
  by a logits processor placed last (one [B, V] tensor alive at a time, never all steps' scores);
- vLLM colocate: TRL's engine runs with ``logprobs_mode="processed_logprobs"`` (the sampled distribution);
- vLLM server: the same, checked at construction (a server in "raw_logprobs" mode is refused);
- a `rollout_func`: its "logprobs". For the Top-K regions they are per token the K+1 cells of spec §2 (µ's top-K
  sorted by µ, then the sampled token when it is not among them, NaN in that slot otherwise), with the token ids in
  "logprob_token_ids" (same shape, TRL 1.16's rollout_func contract). `dppo_rollout_func` returns exactly that.
  The transformers path above records the same cells when the trust region needs them.

Aggregation: TRL's `loss_type` selects one of dppo's aggregation modes (`LOSS_TYPE_AGGREGATION`), with TRL's own
normalisers, so a recipe's learning rate keeps its meaning. TRL's default "dapo" is token-mean over the active tokens
of the whole generation batch (dppo's default, the paper's seq-mean-token-sum-norm, is `loss_type="dr_grpo"`). Ratio
clip ε of the PPO regions are TRL's `epsilon` / `epsilon_high` (None: the registry's 0.28, clip-higher).

Metrics (per micro-batch, one all-reduce; listed in docs/integrations.md): TRL's names where TRL has the quantity
(`clip_ratio/{low,high,region}_mean` = masked tokens by advantage sign, `sampling/sampling_logp_difference/*`,
`entropy`), dppo's otherwise (`dppo/masked_frac*`, `dppo/ratio_*`, `dppo/mismatch/*`, `dppo/unscored_frac`).

TRL is imported here only: `import dppo` never needs it.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

try:
    import trl
    from accelerate.utils import is_peft_model
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    from trl import GRPOConfig, GRPOTrainer
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import pad
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dppo.integrations.trl needs TRL 1.16: pip install --no-deps trl==1.16.0") from exc

from dppo.divergence import topk_kl, topk_tv
from dppo.logprobs import fused_logprobs
from dppo.losses import aggregate, policy_loss
from dppo.metrics import MAXIMA, WEIGHTS, from_sums, masked_shares, mismatch_stats, ratio_stats, to_sums, token_mean
from dppo.rollout.base import SamplingParams
from dppo.train.config import ConfigError, LossConfig
from dppo.trust_region import DEFAULT_TOP_K, TRUST_REGIONS, all_params, needs_topk, region_params

__all__ = ["DPPOConfig", "DPPOTrainer", "DPPORolloutFunc", "LOSS_TYPE_AGGREGATION", "check_server_logprobs",
           "dppo_rollout_func"]

TRL_VERSION = "1.16"
if not trl.__version__.startswith(TRL_VERSION + "."):
    warnings.warn(f"dppo.integrations.trl is written against TRL {TRL_VERSION}.x (it overrides GRPOTrainer's "
                  f"generation and loss methods); found {trl.__version__}", stacklevel=2)

LOSS_TYPE_AGGREGATION = {
    "dapo": "token-mean",  # denominator: active tokens of the whole generation batch, all processes (TRL's default)
    "bnpo": "token-mean",  # denominator: active tokens of the micro-batch
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",  # each sequence's sum / max_completion_length: the paper's (dppo's default)
}
"""TRL `loss_type` -> dppo aggregation mode. The seq-mean modes leave sequences with no active token out of the
count (spec §6), where TRL counts every row; the two differ only with `mask_truncated_completions`."""

_LOSS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossConfig)}
_REGION_FIELDS = tuple(name for name in all_params() if name not in ("eps_low", "eps_high"))
"""Trust-region parameters that become DPPOConfig fields; the ratio-clip ε are TRL's `epsilon`/`epsilon_high`."""
_EPS_FIELDS = {"eps_low": "epsilon", "eps_high": "epsilon_high"}
_UNSUPPORTED = {  # GRPOConfig field -> (the value DPPO needs, why)
    "vllm_importance_sampling_correction": (False, "DPPO's importance weight π/µ already corrects for the engine "
                                                   "mismatch; TRL's would multiply a second ratio into the loss"),
    "importance_sampling_level": ("token", "the trust region and the importance weight are per token"),
    "off_policy_mask_threshold": (None, "a second, sequence-level mask; the trust region is the mask"),
    "delta": (None, "TRL's two-sided ratio cap; DPPO caps the importance weight with is_cap"),
    "top_entropy_quantile": (1.0, "an entropy mask on top of the trust region"),
    "entropy_coef": (0.0, "an entropy bonus is not part of the DPPO objective"),
    "use_adaptive_entropy": (False, "an entropy bonus is not part of the DPPO objective"),
    "use_transformers_continuous_batching": (False, "that generation path returns no sampling log-probs (µ)"),
}
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_LOGIT_SCALING = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_TOPK_DIVERGENCE = {"topk_tv": topk_tv, "topk_kl": topk_kl}
_LOG_WEIGHTS = {**WEIGHTS, "entropy": "n_tokens", "kl": "n_tokens", "unscored_frac": "n_all"}


# --------------------------------------------------------------------------------------------------- config
@dataclass
class _DPPOSettings(GRPOConfig):
    """The DPPO fields of `DPPOConfig` (the trust regions' own parameters are added from the registry below)."""

    trust_region: str = field(default=_LOSS_DEFAULTS["trust_region"], metadata={"help": (
        "A name in dppo.trust_region.TRUST_REGIONS (dppo_binary_tv, dppo_binary_kl, dppo_topk_tv, dppo_topk_kl, "
        "ppo_clip, ppo_clip_relax, none, cppo, pg_is_neg_mask).")})
    is_cap: float = field(default=_LOSS_DEFAULTS["is_cap"], metadata={"help": "C in min(π/µ, C); inf = uncapped."})
    anchor: str = field(default=_LOSS_DEFAULTS["anchor"], metadata={"help": (
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

    def region_settings(self) -> dict[str, Any]:
        """The trust region's mask parameters, defaults filled in and checked (`dppo.trust_region.region_params`)."""
        given = {name: getattr(self, name) for name in _REGION_FIELDS}
        given.update({eps: getattr(self, name) for eps, name in _EPS_FIELDS.items()})
        return region_params(self.trust_region, given)


def _region_field(name: str) -> tuple[str, Any, Any]:
    param = all_params()[name]
    kind = str if isinstance(param.default, str) else float
    return name, kind | None, field(default=None, metadata={"help": param.doc + " None = the region's default."})


DPPOConfig = dataclasses.make_dataclass(
    "DPPOConfig", [_region_field(name) for name in _REGION_FIELDS], bases=(_DPPOSettings,),
    namespace={"__module__": __name__, "__doc__": (
        "`GRPOConfig` plus DPPO's trust region: trust_region, is_cap, anchor, top_k_logprobs and one field per "
        "trust-region parameter (delta_low, delta_high, relax_alpha, relax_side, cppo_*, neg_delta; None = the "
        "region's default), with the defaults and checks of dppo's own `loss` config. Errors are ValueErrors naming "
        "the field, raised at construction. `loss_type` picks the aggregation (`LOSS_TYPE_AGGREGATION`).")})


def _check_dppo(cfg) -> None:
    """DPPOConfig's checks; ValueError naming the field."""
    for name, (needed, why) in _UNSUPPORTED.items():
        if getattr(cfg, name) != needed:
            raise ValueError(f"{name}: DPPOConfig needs {needed!r} ({why}), got {getattr(cfg, name)!r}")
    if cfg.loss_type not in LOSS_TYPE_AGGREGATION:
        raise ValueError(f"loss_type: {cfg.loss_type!r} has no DPPO aggregation; valid: "
                         + ", ".join(f"{k} ({v})" for k, v in LOSS_TYPE_AGGREGATION.items()))
    region = {name: getattr(cfg, name) for name in _REGION_FIELDS}
    try:  # the checks of dppo's own `loss` config section, so that both accept and refuse the same values
        LossConfig(trust_region=cfg.trust_region, anchor=cfg.anchor, is_cap=cfg.is_cap, aggregation=cfg.aggregation,
                   eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, **region)
    except ConfigError as exc:  # "loss.eps_low: ..." -> "epsilon: ..."
        name, _, rest = str(exc).removeprefix("loss.").partition(":")
        raise ValueError(f"{_EPS_FIELDS.get(name, name)}:{rest}") from None
    if cfg.top_k_logprobs is not None and not (isinstance(cfg.top_k_logprobs, int) and cfg.top_k_logprobs >= 0):
        raise ValueError(f"top_k_logprobs: expected an int >= 0 or None, got {cfg.top_k_logprobs!r}")
    k = cfg.resolved_top_k_logprobs
    if needs_topk(cfg.trust_region) and k < 1:
        raise ValueError(f"top_k_logprobs: trust region {cfg.trust_region!r} needs µ's top-K log-probs: set >= 1 "
                         f"(or leave it None for {DEFAULT_TOP_K})")
    if k > 0:
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", None)):
            if getattr(cfg, name) not in (off, None):
                raise ValueError(f"{name}: truncated sampling changes µ, so µ's recorded top-K cells would not be "
                                 "those of the sampled distribution; use top_p=1.0, top_k=0, min_p=None with top-K "
                                 f"capture (top_k_logprobs={k}), got {name}={getattr(cfg, name)!r}")


def check_server_logprobs(server_info: dict) -> None:
    """A vLLM server must return processed log-probs (after temperature: µ), not its default raw ones."""
    mode = server_info.get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        raise ValueError(f"vllm_mode: the vLLM server returns {mode!r} log-probs, which are not those of the sampled "
                         "distribution µ; restart it with `--logprobs-mode processed_logprobs` (trl vllm-serve does)")


# --------------------------------------------------------------------------------------------------- µ recording
class _MuRecorder(LogitsProcessor):
    """The last logits processor of a sampling `generate`: log µ of every drawn token, from the final scores that
    `generate` softmaxes and samples from, and µ's top-K. Holds one step's [B, V] scores (a reference, no copy); the
    token drawn at step t is read from `input_ids` at step t + 1, the last one in `finish`."""

    def __init__(self, k: int) -> None:
        self.k, self.scores, self.lse = k, None, None
        self.logp: list[Tensor] = []
        self.top: list[tuple[Tensor, Tensor]] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.scores is not None:
            self._take(input_ids[:, -1])
        self.scores, self.lse = scores, torch.logsumexp(scores.float(), -1, keepdim=True)
        if self.k:
            values, ids = scores.float().topk(self.k, -1)
            self.top.append((ids, values - self.lse))
        return scores

    def _take(self, tokens: Tensor) -> None:
        self.logp.append((self.scores.float().gather(-1, tokens[:, None]) - self.lse)[:, 0])
        self.scores = None

    def finish(self, completion: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """log µ [B, T] of `completion` [B, T] (and µ's top-K ids, log-probs [B, T, K]). Steps past T (a deferred
        stop check decodes one more) are dropped."""
        T = completion.shape[1]
        if len(self.logp) < T:
            self._take(completion[:, len(self.logp)])
        logp = torch.stack(self.logp[:T], 1)
        if not self.k:
            return logp, None
        return logp, (torch.stack([i for i, _ in self.top[:T]], 1), torch.stack([v for _, v in self.top[:T]], 1))


def _recording_generation(model, generation_config, k: int):
    """(config, processors, recorder) that sample exactly as `generation_config` does while `_MuRecorder` sees the
    final scores: temperature/top-k/top-p/min-p (the warpers `generate` would append after any custom processor)
    are built here in `generate`'s order, then the recorder, and switched off in the config."""
    effective, _ = model._prepare_generation_config(generation_config)  # the values generate would use
    odd = {"top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "renormalize_logits": False,
           "watermarking_config": None}
    for name, neutral in odd.items():
        if getattr(effective, name, neutral) not in (neutral, None):
            raise ValueError(f"generation_kwargs: {name}={getattr(effective, name)!r} is not supported by DPPOTrainer's "
                             "µ recording (temperature, top_k, top_p, min_p and the logits processors are)")
    warpers = []
    if effective.temperature not in (None, 1.0):
        warpers.append(TemperatureLogitsWarper(effective.temperature))
    if effective.top_k:
        warpers.append(TopKLogitsWarper(top_k=effective.top_k))
    if effective.top_p is not None and effective.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=effective.top_p))
    if effective.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=effective.min_p))
    config = copy.deepcopy(generation_config)
    # min_p 0.0 rather than None, which generate would fill in again from the model's own config (0.0: a no-op warper)
    config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0
    config.min_p = 0.0 if effective.min_p is not None else None
    recorder = _MuRecorder(k)
    return config, LogitsProcessorList([*warpers, recorder]), recorder


def _cells(tokens: Tensor, logp: Tensor, top_ids: Tensor, top_logp: Tensor) -> tuple[Tensor, Tensor]:
    """The K+1 layout of spec §2 with NaN for an unused slot: µ's top-K, then the sampled token when not among them."""
    in_topk = (top_ids == tokens[..., None]).any(-1)
    ids = torch.cat([top_ids, torch.where(in_topk, 0, tokens)[..., None]], -1)
    lps = torch.cat([top_logp, torch.where(in_topk, float("nan"), logp)[..., None]], -1)
    return ids, lps


# --------------------------------------------------------------------------------------------------- trainer
class DPPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with DPPO's loss: `args` must be a `DPPOConfig`; every other argument is GRPOTrainer's.

    µ comes from the generation backend (module docstring); the Top-K regions need µ's top-K, recorded by the
    transformers path or returned by a `rollout_func` (`dppo_rollout_func`); TRL's own vLLM path keeps only the
    sampled token's log-prob, so with vLLM a Top-K region needs `rollout_func=dppo_rollout_func("vllm")`.
    """

    _tag_names = ["trl", "grpo", "dppo"]
    _name = "DPPO"
    _paper = {"title": "Rethinking the Trust Region in LLM Reinforcement Learning", "id": "2602.04879",
              "citation": "@article{qi2026dppo, title={Rethinking the Trust Region in LLM Reinforcement Learning}, "
                          "author={Qi and Zhou and Liu and Pang and Du and Lin and Lee}, year=2026, "
                          "eprint={arXiv:2602.04879}}"}

    def __init__(self, model, reward_funcs=None, args=None, *positional, rollout_func=None, tools=None, **kwargs):
        if args is None:  # as GRPOTrainer does: "<model name>-DPPO" as the output folder
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
            args = DPPOConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-DPPO")
        if not isinstance(args, DPPOConfig):
            raise ValueError(f"args: DPPOTrainer needs a DPPOConfig, got {type(args).__name__}")
        topk = needs_topk(args.trust_region)
        if topk and rollout_func is None and args.use_vllm:
            raise ValueError(f"trust_region: {args.trust_region!r} needs µ's top-K log-probs, and TRL's vLLM "
                             "generation keeps only the sampled token's; pass rollout_func=dppo_rollout_func('vllm')")
        if topk and tools:
            raise ValueError(f"tools: the tool-calling loop does not keep µ's top-K cells ({args.trust_region!r})")
        super().__init__(model, reward_funcs, args, *positional, rollout_func=rollout_func, tools=tools, **kwargs)
        self._region = args.region_settings()
        self._topk = topk
        self._k = args.resolved_top_k_logprobs
        self._pending_topk_ids = self._recorded_topk_ids = None
        if topk:
            text_config = self.model.config.get_text_config()
            scaled = [n for n in _LOGIT_SCALING if getattr(text_config, n, None) not in (None, 1.0)]
            if scaled:
                raise ValueError(f"trust_region: {args.trust_region!r} is not supported for models that scale their "
                                 f"logits ({', '.join(scaled)}): π's top-K cells are computed without it")
        if args.use_vllm and args.vllm_mode == "server" and self.accelerator.is_main_process:
            check_server_logprobs(self.vllm_generation.vllm_client.get_server_info())
        if isinstance(rollout_func, DPPORolloutFunc):
            rollout_func.prepare(self)

    # --- generation: record µ --------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:  # processed (sampled-distribution) log-probs of the sampled tokens
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images is not None or multimodal_fields:
            raise ValueError("DPPOTrainer records µ in the transformers generation path for text-only prompts; use "
                             "vLLM or a rollout_func for multimodal prompts")
        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, self._tokenizer.pad_token_id, "left", self.pad_to_multiple_of).to(device)
        attention = pad([torch.ones_like(p) for p in prompts], 0, "left", self.pad_to_multiple_of).to(device)
        unwrapped = unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            generation_kwargs=self.generation_kwargs,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
        with unwrapped as model, torch.no_grad(), self._dist.summon_full_params(self.model_wrapped, recurse=False):
            config, processors, recorder = _recording_generation(model, self.generation_config, self._k)
            out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                                 logits_processor=processors)
        completion = out[:, input_ids.size(1):]
        logp, top = recorder.finish(completion)
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=device))
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.size(1)).tolist()
        completion_ids = [row[:n].tolist() for row, n in zip(completion.cpu(), lengths)]
        if top is None:
            return completion_ids, [row[:n].tolist() for row, n in zip(logp.cpu(), lengths)]
        ids, lps = _cells(completion, logp, *top)
        self._recorded_topk_ids = [row[:n].tolist() for row, n in zip(ids.cpu(), lengths)]
        return completion_ids, [row[:n].tolist() for row, n in zip(lps.cpu(), lengths)]

    def _generate(self, prompts: list):
        self._recorded_topk_ids = None
        out = super()._generate(prompts)
        extra_fields = out[5]  # µ's top-K ids travel beside the log-probs, not to the reward functions
        ids = extra_fields.pop("logprob_token_ids", None)
        self._pending_topk_ids = ids if ids is not None else self._recorded_topk_ids
        return out

    def _generate_and_score_completions(self, inputs):
        self._pending_topk_ids = None
        output = super()._generate_and_score_completions(inputs)
        mu = output.get("sampling_per_token_logps")
        if mu is None:
            raise RuntimeError("the generation gave no sampling log-probs (µ); a rollout_func must return 'logprobs'")
        if mu.dim() == 3:
            output.update(self._split_cells(mu, output["completion_ids"], output["completion_mask"]))
        elif self._topk:
            raise ValueError(f"trust_region: {self.args.trust_region!r} needs µ's top-K log-probs; the rollout gave "
                             "only the sampled tokens': a rollout_func must return per-token K+1 cells in 'logprobs' "
                             "and 'logprob_token_ids' (see dppo_rollout_func)")
        if self._topk and self.args.anchor == "recompute" and "old_per_token_logps" in output:
            output["old_topk_logp"] = self._old_topk_cells(output)
        return output

    def _split_cells(self, mu: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
        """[B, T, K+1] cells -> µ at the sampled tokens [B, T], and the cells' ids, log-probs (0 if unused), valid."""
        if self._pending_topk_ids is None:
            raise ValueError("logprob_token_ids: the rollout returned per-token cells in 'logprobs' without their ids")
        if mu.shape[-1] != self._k + 1:
            raise ValueError(f"top_k_logprobs: the rollout gave {mu.shape[-1]} cells per token, expected K+1 = "
                             f"{self._k + 1}")
        ids = pad([torch.tensor(x, dtype=torch.long).reshape(-1, mu.shape[-1]) for x in self._pending_topk_ids], 0,
                  "right").to(mu.device)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, mu.shape[1] - ids.shape[1]))
        valid = ~torch.isnan(mu)
        match = (ids == completion_ids[..., None]) & valid
        found = match.any(-1)
        if (completion_mask.bool() & ~found).any():
            raise ValueError("logprob_token_ids: a sampled token is missing from its µ cells (expected µ's top-K, "
                             "then the sampled token when it is not among them)")
        cells = mu.nan_to_num(0.0)
        sampled = torch.where(found, cells.gather(-1, match.int().argmax(-1, keepdim=True))[..., 0], float("nan"))
        return {"sampling_per_token_logps": sampled, "rollout_topk_ids": ids, "rollout_topk_logp": cells,
                "rollout_topk_valid": valid}

    # --- the loss ---------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        T = completion_ids.size(1)
        capture = _HiddenCapture(self._backbone(model)) if "rollout_topk_ids" in inputs else nullcontext()
        with capture:
            logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention, T, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
                **{k: inputs.get(k) for k in _FORWARD_KEYS})
        rollout_logp = inputs["sampling_per_token_logps"]
        unscored = mask.bool() & torch.isnan(rollout_logp)  # vLLM could not score these: no µ, no loss term
        mask = mask.bool() & ~unscored
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp
        divergence = cells = None
        if "rollout_topk_ids" in inputs:  # π at µ's cells: the Top-K divergence, or Top-K mismatch metrics only
            cells = self._topk_cells(model, capture.hidden, completion_ids, inputs["rollout_topk_ids"], mask)
        if self._topk:
            anchor_cells = inputs["rollout_topk_logp"]
            if self.args.anchor == "recompute":
                anchor_cells = inputs.get("old_topk_logp", cells)
            divergence = _TOPK_DIVERGENCE[TRUST_REGIONS[self.args.trust_region].divergence](
                cells, anchor_cells, inputs["rollout_topk_valid"])
        aggregation, denominator, scale = self._aggregation(inputs, mode)
        norm = self.max_completion_length if aggregation == "seq-mean-token-sum-norm" else None
        recompute = self.args.anchor == "recompute"
        loss, stats = policy_loss(
            logp, rollout_logp, inputs["advantages"], mask, trust_region=self.args.trust_region, is_cap=self.args.is_cap,
            aggregation=aggregation, divergence=divergence, old_logp=old_logp if recompute else None,
            anchor=self.args.anchor, max_response_len=norm, denominator=denominator, **self._region)
        kl = None
        if self.beta != 0.0:  # TRL's k3 estimate of KL(π‖ref), aggregated like the policy term
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * torch.exp(logp - old_logp)
            loss = loss + self.beta * aggregate(kl, mask, aggregation, max_response_len=norm, denominator=denominator)
        loss = loss / scale
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_dppo(mode, logp, rollout_logp, inputs["advantages"], mask, unscored, stats, entropy, kl, cells, inputs)
        return loss

    def _aggregation(self, inputs, mode: str) -> tuple[str, Tensor | None, float]:
        """(dppo aggregation mode, its denominator or None for the micro-batch's own count, divisor of the loss),
        reproducing the normalisers of TRL's `loss_type`."""
        aggregation = LOSS_TYPE_AGGREGATION[self.loss_type]
        if self.loss_type == "dapo":  # the generation batch's tokens, rescaled to one accumulation window per process
            denominator = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                denominator = denominator * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return aggregation, denominator, 1.0
        return aggregation, None, float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0

    def _backbone(self, model):
        """(the decoder stack whose output feeds the lm-head, the lm-head) of the policy."""
        unwrapped = self.accelerator.unwrap_model(model)
        if is_peft_model(unwrapped):
            unwrapped = unwrapped.get_base_model()
        return unwrapped.base_model, unwrapped.get_output_embeddings()

    @torch.no_grad()
    def _topk_cells(self, model, hidden: Tensor, completion_ids: Tensor, topk_ids: Tensor, mask: Tensor) -> Tensor:
        """π's log-probs [B, T, K+1] (detached, 0 off `mask`) at µ's cells, from the captured last hidden states: one
        extra lm-head pass over the response tokens (`dppo.logprobs.fused_logprobs`, no [N, V] tensor)."""
        _, head = self._backbone(model)
        T = completion_ids.size(1)
        h = hidden[:, -T - 1:-1][mask].to(head.weight.dtype)
        bias = None if head.bias is None else head.bias.detach()
        out = fused_logprobs(h, head.weight.detach(), completion_ids[mask], bias=bias, topk_ids=topk_ids[mask],
                             temperature=self.temperature)
        cells = torch.zeros(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
        cells[mask] = out.topk_logp.float()
        return cells

    @torch.no_grad()
    def _old_topk_cells(self, output: dict) -> Tensor:
        """π_old's cells for anchor="recompute" when TRL recomputed π_old (one more no-grad forward of the batch)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        mask, T = output["completion_mask"].bool(), output["completion_ids"].size(1)
        step = self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        cells = []
        for s in range(0, ids.size(0), step):
            with _HiddenCapture(self._backbone(self.model)) as capture:
                self._get_per_token_logps_and_entropies(self.model, ids[s:s + step], attention[s:s + step], T)
            cells.append(self._topk_cells(self.model, capture.hidden, output["completion_ids"][s:s + step],
                                          output["rollout_topk_ids"][s:s + step], mask[s:s + step]))
        return torch.cat(cells)

    @torch.no_grad()
    def _log_dppo(self, mode, logp, rollout_logp, adv, mask, unscored, stats, entropy, kl, cells, inputs) -> None:
        """TRL's and dppo's metrics of one micro-batch (module docstring; the statistics are `dppo.metrics`'): one
        all-reduce of sums, one of maxima."""
        m = rollout_logp.nan_to_num(0.0)  # unscored tokens (NaN µ) are outside `mask`: they count nowhere
        topk = {} if cells is None else {"logp_cells": cells, "rollout_cells": inputs["rollout_topk_logp"],
                                         "cells_valid": inputs["rollout_topk_valid"]}
        local = {**mismatch_stats(logp, m, mask, **topk), **masked_shares(stats["keep"], adv, mask),
                 **ratio_stats(logp, m, mask, is_cap=self.args.is_cap)}
        local["entropy"], _ = token_mean(entropy, mask)
        local["unscored_frac"], local["n_all"] = token_mean(unscored, unscored | mask)
        if kl is not None:
            local["kl"], _ = token_mean(kl, mask)
        sums = to_sums(local, _LOG_WEIGHTS)
        names = [k for k in sums if k not in MAXIMA]
        total = self.accelerator.reduce(torch.stack([sums[k] for k in names]), reduction="sum")
        peak = self.accelerator.reduce(torch.stack([sums[k] for k in MAXIMA]), reduction="max")
        reduced = {**dict(zip(names, total)), **dict(zip(MAXIMA, peak))}
        means = from_sums(reduced, _LOG_WEIGHTS)
        n = reduced["n_tokens"].clamp(min=1)
        means["masked_pos_share"] = reduced["masked_frac_pos"] / n  # masked with Â>0, as a share of all tokens
        means["masked_neg_share"] = reduced["masked_frac_neg"] / n
        v = dict(zip(means, torch.stack(list(means.values())).tolist()))
        metrics = {
            "clip_ratio/region_mean": v["masked_frac"], "clip_ratio/high_mean": v["masked_pos_share"],
            "clip_ratio/low_mean": v["masked_neg_share"], "dppo/masked_frac": v["masked_frac"],
            "dppo/masked_frac_pos": v["masked_frac_pos"], "dppo/masked_frac_neg": v["masked_frac_neg"],
            "dppo/ratio_mean": v["ratio_mean"], "dppo/ratio_max": v["ratio_max"],
            "dppo/ratio_above_cap_frac": v["ratio_above_cap_frac"],
            "sampling/sampling_logp_difference/mean": v["abs_log_ratio_mean"],
            "sampling/sampling_logp_difference/max": v["abs_log_ratio_max"], "dppo/mismatch/tv_mean": v["binary_tv_mean"],
            "dppo/mismatch/kl_mean": v["binary_kl_mean"],
            "dppo/mismatch/log_ratio_gt_log2_frac": v["log_ratio_gt_log2_frac"],
            "dppo/unscored_frac": v["unscored_frac"], "entropy": v["entropy"]}
        if "kl" in v:
            metrics["kl"] = v["kl"]
        if "topk_tv_mean" in v:
            metrics["dppo/mismatch/topk_tv_mean"] = v["topk_tv_mean"]
            metrics["dppo/mismatch/topk_kl_mean"] = v["topk_kl_mean"]
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)


class _HiddenCapture:
    """Keeps the last hidden states [B, L, H] that a decoder stack hands to the lm-head during the body (no copy)."""

    def __init__(self, backbone_and_head) -> None:
        self.module = backbone_and_head[0]
        self.parts: list[Tensor] = []

    def __enter__(self) -> _HiddenCapture:
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output) -> None:
        self.parts.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    @property
    def hidden(self) -> Tensor:
        if not self.parts:
            raise RuntimeError("the policy's forward did not run its decoder stack (no hidden states captured)")
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


# --------------------------------------------------------------------------------------------------- rollout_func
class DPPORolloutFunc:
    """A TRL `rollout_func` sampling with a dppo engine ("hf", "vllm" or an `Engine`): per completion its prompt ids,
    token ids and log µ, and with top-K capture per token µ's K+1 cells (NaN in an unused slot) in "logprobs" and
    their ids in "logprob_token_ids". The engine is built and checked when `DPPOTrainer` is constructed (it copies
    the policy; its weights are synced from the trainer whenever the optimiser has stepped). Identical prompts in
    blocks of num_generations (TRL's sampler) are prefilled once and sampled n times."""

    def __init__(self, engine: Any = "hf", **engine_kwargs: Any) -> None:
        if isinstance(engine, str) and engine not in ("hf", "vllm"):
            raise ValueError(f"engine: unknown {engine!r}; valid: 'hf', 'vllm' or an Engine instance")
        self.spec, self.engine_kwargs = engine, engine_kwargs
        self.engine = None if isinstance(engine, str) else engine
        self.k = 0
        self._synced_step: int | None = None

    def prepare(self, trainer) -> None:
        """Check the trainer's settings against the engine and build it (errors name the field)."""
        args = trainer.args
        self.k = args.resolved_top_k_logprobs
        for name, off in (("min_p", None), ("repetition_penalty", 1.0), ("generation_kwargs", None)):
            value = getattr(args, name)
            if value != off and value != {}:
                raise ValueError(f"{name}: dppo_rollout_func's engines do not apply it, so µ would not be the "
                                 f"distribution configured; leave it at {off!r}, got {value!r}")
        SamplingParams(top_k_logprobs=self.k, top_p=args.top_p, top_k=args.top_k)  # refuses truncation with top-K
        model = trainer.accelerator.unwrap_model(trainer.model)
        if is_peft_model(model):
            raise ValueError("model: dppo_rollout_func syncs full weights; a PEFT model needs TRL's own generation")
        if isinstance(self.spec, str):  # built from this trainer's policy (a second trainer gets a fresh engine)
            self.close()
            self.engine = self._build(model, trainer.processing_class, args)
        if self.k > self.engine.max_logprobs:
            raise ValueError(f"top_k_logprobs: {self.k} exceeds the engine's cap max_logprobs={self.engine.max_logprobs}"
                             " (vLLM: dppo_rollout_func('vllm', max_logprobs=K))")
        self._synced_step = trainer.state.global_step if isinstance(self.spec, str) else None

    def _build(self, model, tokenizer, args):
        if self.spec == "hf":
            from dppo.rollout.hf import HFEngine

            clone = copy.deepcopy(model)
            vars(clone).pop("forward", None)  # TRL's fused-head forward is bound to (and runs) the trainer's module
            return HFEngine(clone, tokenizer, seed=args.seed, copy=False, **self.engine_kwargs)
        from dppo.rollout.vllm import VLLMEngine

        kwargs = {"max_logprobs": max(self.k, 20), "dtype": next(model.parameters()).dtype, **self.engine_kwargs}
        return VLLMEngine(model, tokenizer, seed=args.seed, **kwargs)

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if self.engine is None:
            raise RuntimeError("dppo_rollout_func: not prepared; pass it to DPPOTrainer(rollout_func=...)")
        args = trainer.args
        if self._synced_step != trainer.state.global_step:
            self.engine.load_weights(trainer.accelerator.unwrap_model(trainer.model).state_dict())
            self._synced_step = trainer.state.global_step
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
        if images is not None:
            raise ValueError("prompts: dppo_rollout_func samples text-only prompts")
        g = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        n = len(prompt_ids)
        grouped = n % g == 0 and all(prompt_ids[i] == prompt_ids[i - i % g] for i in range(n))
        params = SamplingParams(n=g if grouped else 1, temperature=args.temperature,
                                max_new_tokens=args.max_completion_length, stop_token_ids=tuple(trainer.eos_token_ids),
                                top_k_logprobs=self.k, top_p=args.top_p, top_k=args.top_k)
        rollouts = self.engine.generate([list(p) for p in (prompt_ids[::g] if grouped else prompt_ids)], params)
        out = {"prompt_ids": [r.prompt_ids.tolist() for r in rollouts],
               "completion_ids": [r.response_ids.tolist() for r in rollouts]}
        if not self.k:
            out["logprobs"] = [r.rollout_logp.tolist() for r in rollouts]
            return out
        out["logprobs"] = [torch.where(r.rollout_topk_valid, r.rollout_topk_logp, float("nan")).tolist() for r in rollouts]
        out["logprob_token_ids"] = [r.rollout_topk_ids.tolist() for r in rollouts]
        return out

    def close(self) -> None:
        """Free the engine (vLLM's memory and temporary model folder)."""
        if self.engine is not None and isinstance(self.spec, str):
            self.engine.close()
            self.engine = None


def dppo_rollout_func(engine: Any = "hf", **engine_kwargs: Any) -> DPPORolloutFunc:
    """A TRL `rollout_func` on dppo's `engine` ("hf", "vllm" or an `Engine`); `engine_kwargs` go to the engine's
    constructor (e.g. `max_batch_rows` for hf, `max_logprobs`, `kv_cache_gb` for vLLM). K comes from the trainer's
    `DPPOConfig`. Pass it as `DPPOTrainer(..., rollout_func=dppo_rollout_func("vllm"))`."""
    return DPPORolloutFunc(engine, **engine_kwargs)
