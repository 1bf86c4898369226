"""`DPPOTrainer`: TRL's `GRPOTrainer` with DPPO's loss (`dppo.losses.policy_loss` on TRL's per-token tensors).

It overrides three things of GRPOTrainer: the transformers generation (to record µ, `recorder`, for every turn of
TRL's tool loop too), the post-processing of a generation batch (µ checked against the completions, then µ's K+1 cells
split into ids, log-probs and valid slots), and the loss with its metrics (`dppo.metrics`, one all-reduce of sums and
one of maxima per micro-batch). GRPOTrainer's terms that are orthogonal to the trust region (entropy bonus, adaptive
entropy, entropy filter, off-policy sequence mask) compose with it as in GRPOTrainer (`terms`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from dppo.divergence import topk_kl, topk_tv
from dppo.integrations.trl.config import LOSS_TYPE_AGGREGATION, DPPOConfig, check_sampling, check_server_logprobs
from dppo.integrations.trl.recorder import TurnCells, _cells, _recording_generation
from dppo.integrations.trl.rollout_func import DPPORolloutFunc
from dppo.integrations.trl.terms import entropy_mean, next_entropy_coef, off_policy_keep, select_advantages
from dppo.logprobs import fused_logprobs
from dppo.losses import TokenInputs, aggregate, policy_loss
from dppo.metrics import (MAXIMA, NAMES, WEIGHTS, from_sums, masked_shares, mismatch_stats, ratio_stats, to_sums,
                          token_mean)
from dppo.trust_region import TRUST_REGIONS, needs_topk

__all__ = ["DPPOTrainer"]

_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_LOGIT_SCALING = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_TOPK_DIVERGENCE = {"topk_tv": topk_tv, "topk_kl": topk_kl}
_LOG_WEIGHTS = {**WEIGHTS, "entropy": "n_tokens", "kl": "n_tokens", "unscored_frac": "n_all",
                "off_policy_masked_frac": "n_all", "policy_loss": "n_ranks"}


class DPPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with DPPO's loss: `args` must be a `DPPOConfig`; every argument is GRPOTrainer's, in its order.

    µ comes from the generation backend (the `dppo.integrations.trl` docstring); the Top-K regions need µ's top-K,
    recorded by the transformers path (every turn of the tool loop included) or returned by a `rollout_func`
    (`dppo_rollout_func`); TRL's own vLLM path keeps only the sampled token's log-prob, so with vLLM a Top-K region
    needs `rollout_func=dppo_rollout_func("vllm")`.
    """

    # State the overridden methods read, at a neutral value before __init__ sets it: TRL's own tests build trainers
    # with object.__new__ and set only what GRPOTrainer's methods read (no top-K capture, nothing pending).
    _k = 0
    _turn_cells: TurnCells | None = None
    _pending_topk_ids = _pending_cells = None
    _tag_names = ["trl", "grpo", "dppo"]
    _name = "DPPO"
    _paper = {"title": "Rethinking the Trust Region in LLM Reinforcement Learning", "id": "2602.04879",
              "citation": "@article{qi2026dppo, title={Rethinking the Trust Region in LLM Reinforcement Learning}, "
                          "author={Qi and Zhou and Liu and Pang and Du and Lin and Lee}, year=2026, "
                          "eprint={arXiv:2602.04879}}"}

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        if args is None:  # as GRPOTrainer does: "<model name>-DPPO" as the output folder
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
            args = DPPOConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-DPPO")
        if not isinstance(args, DPPOConfig):
            raise ValueError(f"args: DPPOTrainer needs a DPPOConfig, got {type(args).__name__}")
        self._check_backends(args, rollout_func, tools, environment_factory)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config, tools=tools,
                         rollout_func=rollout_func, environment_factory=environment_factory)
        self._spec = args.spec()  # resolved once, by the function `dppo train` builds its spec with
        self._inputs = self._spec.region.inputs
        self._topk = self._spec.region.needs_topk
        if self._spec.region.batch_stats and self.accelerator.num_processes > 1:
            raise ValueError(f"trust_region: {args.trust_region!r} reads statistics of the whole optimiser batch "
                             f"({', '.join(self._spec.region.batch_stats)}), which DPPOTrainer computes over one "
                             f"process's micro-batch; run it in one process (got {self.accelerator.num_processes})")
        self._k = args.resolved_top_k_logprobs
        self._turn_cells = TurnCells(self._k)
        self._pending_topk_ids = self._pending_cells = None
        if self._topk:
            text_config = self.model.config.get_text_config()
            scaled = [n for n in _LOGIT_SCALING if getattr(text_config, n, None) not in (None, 1.0)]
            if scaled:
                raise ValueError(f"trust_region: {args.trust_region!r} is not supported for models that scale their "
                                 f"logits ({', '.join(scaled)}): π's top-K cells are computed without it")
        if not self.use_vllm and (rollout_func is None or self.tools):  # TRL's transformers generate will run
            effective, _ = self.accelerator.unwrap_model(self.model)._prepare_generation_config(self.generation_config)
            check_sampling(vars(effective), "model.generation_config", self._k)  # generation_kwargs: in DPPOConfig
        if args.use_vllm and args.vllm_mode == "server" and self.accelerator.is_main_process:
            check_server_logprobs(self.vllm_generation.vllm_client.get_server_info())
        if isinstance(rollout_func, DPPORolloutFunc):
            rollout_func.prepare(self)

    @staticmethod
    def _check_backends(args, rollout_func, tools, environment_factory) -> None:
        """Generation backends that cannot give the µ this config needs, refused before a model loads."""
        if needs_topk(args.trust_region) and rollout_func is None and args.use_vllm:
            raise ValueError(f"trust_region: {args.trust_region!r} needs µ's top-K log-probs, and TRL's vLLM "
                             "generation keeps only the sampled token's; pass rollout_func=dppo_rollout_func('vllm')")
        k = args.resolved_top_k_logprobs
        if k and rollout_func is not None and (tools or environment_factory):
            name = "tools" if tools else "environment_factory"
            raise ValueError(f"{name}: with a rollout_func, TRL generates the turns after a tool call with its own "
                             f"generation, so the rollout_func's µ cells of the first turn and the later turns' cannot "
                             f"be joined (top_k_logprobs={k}); for top-K with tools leave rollout_func unset "
                             "(DPPOTrainer records every turn's cells)")

    # --- generation: record µ --------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:  # processed (sampled-distribution) log-probs of the sampled tokens
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("prompts: DPPOTrainer records µ in the transformers generation path for text-only prompts "
                             "(multimodal prompts or tool images: use vLLM or a rollout_func; docs/integrations.md)")
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
        if top is not None:  # µ's cells, kept by context for `_generate` (TRL's tool loop carries scalars only)
            ids, lps = _cells(completion, logp, *top)
            for prompt, tokens, row_ids, row_lps in zip(prompt_ids, completion_ids, ids.cpu(), lps.cpu()):
                self._turn_cells.record(prompt, tokens, row_ids[:len(tokens)], row_lps[:len(tokens)])
        return completion_ids, [row[:n].tolist() for row, n in zip(logp.cpu(), lengths)]

    def _generate(self, prompts: list):
        self._turn_cells = TurnCells(self._k)
        out = super()._generate(prompts)
        prompt_ids, completion_ids, tool_mask, _, logprobs, extra_fields = out[:6]
        _check_alignment(completion_ids, logprobs, "logprobs")
        ids = extra_fields.pop("logprob_token_ids", None)  # µ's top-K ids travel beside µ, not to the reward funcs
        if ids is not None:  # from a rollout_func, in the K+1 layout
            _check_alignment(completion_ids, ids, "logprob_token_ids")
            self._pending_topk_ids = ids
        elif self._k and self.rollout_func is None and not self.use_vllm:  # recorded by `_generate_single_turn`
            self._pending_cells = self._turn_cells.assemble(prompt_ids, completion_ids, tool_mask)
        self._turn_cells = TurnCells(self._k)
        return out

    def _generate_and_score_completions(self, inputs):
        self._pending_topk_ids = self._pending_cells = None
        output = super()._generate_and_score_completions(inputs)
        mu = output.get("sampling_per_token_logps")
        if mu is None:
            raise RuntimeError("µ was not recorded: the generation gave no sampling log-probs (a rollout_func must "
                               "return 'logprobs')")
        completion_ids = output["completion_ids"]
        if mu.shape[:2] != completion_ids.shape:
            raise RuntimeError(f"µ alignment: sampling log-probs of shape {tuple(mu.shape)} for completions of shape "
                               f"{tuple(completion_ids.shape)}")
        mask = _generated(output)
        if self._pending_cells is not None:  # the transformers path's cells, every turn
            ids, lps = self._pending_cells
            cells = pad(lps, float("nan"), "right").to(mu.device)
            cells = torch.nn.functional.pad(cells, (0, 0, 0, mu.shape[1] - cells.shape[1]), value=float("nan"))
            output.update(self._split_cells(cells, ids, completion_ids, mask))
        elif mu.dim() == 3:
            output.update(self._split_cells(mu, self._pending_topk_ids, completion_ids, mask))
        elif self._topk:
            raise ValueError(f"trust_region: {self.args.trust_region!r} needs µ's top-K log-probs; the rollout gave "
                             "only the sampled tokens': a rollout_func must return per-token K+1 cells in 'logprobs' "
                             "and 'logprob_token_ids' (see dppo_rollout_func)")
        if self._topk and self.args.anchor == "recompute" and "old_per_token_logps" in output:
            output["old_topk_logp"] = self._old_topk_cells(output)
        if "staleness" in self._inputs:  # the optimiser step the batch was sampled at (TRL splits it with the rows)
            output["generation_step"] = torch.full((completion_ids.shape[0],), self.state.global_step,
                                                   device=completion_ids.device)
        return output

    def _split_cells(self, mu: Tensor, topk_ids: list | None, completion_ids: Tensor,
                     mask: Tensor) -> dict[str, Tensor]:
        """[B, T, K+1] cells and their ids (per completion, [n, K+1]) -> µ at the sampled tokens [B, T], and the cells'
        ids, log-probs (0 if unused) and valid slots. Every generated token (`mask`) must be among its cells."""
        if topk_ids is None:
            raise ValueError("logprob_token_ids: the rollout returned per-token cells in 'logprobs' without their ids")
        if mu.shape[-1] != self._k + 1:
            raise ValueError(f"top_k_logprobs: the rollout gave {mu.shape[-1]} cells per token, expected K+1 = "
                             f"{self._k + 1}")
        ids = pad([torch.as_tensor(x, dtype=torch.long).reshape(-1, mu.shape[-1]) for x in topk_ids], 0,
                  "right").to(mu.device)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, mu.shape[1] - ids.shape[1]))
        valid = ~torch.isnan(mu)
        match = (ids == completion_ids[..., None]) & valid
        found = match.any(-1)
        if (mask & ~found).any():
            raise ValueError("logprob_token_ids: a sampled token is missing from its µ cells (expected µ's top-K, "
                             "then the sampled token when it is not among them)")
        cells = mu.nan_to_num(0.0)
        sampled = torch.where(found, cells.gather(-1, match.int().argmax(-1, keepdim=True))[..., 0], float("nan"))
        return {"sampling_per_token_logps": sampled, "rollout_topk_ids": ids, "rollout_topk_logp": cells,
                "rollout_topk_valid": valid & mask[..., None]}

    # --- the loss ---------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        generated = _generated(inputs)  # GRPOTrainer's mask: completion tokens the model generated
        T = completion_ids.size(1)
        capture = _HiddenCapture(self._backbone(model)) if "rollout_topk_ids" in inputs else nullcontext()
        with capture:
            logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention, T, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
                **{k: inputs.get(k) for k in _FORWARD_KEYS})
        rollout_logp = inputs["sampling_per_token_logps"]
        unscored = generated & torch.isnan(rollout_logp)  # vLLM could not score these: no µ, no loss term
        mask = generated & ~unscored
        adv = inputs["advantages"]
        selected, entropy_mask, off_policy = self._selected(logp, rollout_logp, adv, entropy, generated)
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
        staleness = None
        if "staleness" in self._inputs:  # optimiser steps since the batch was sampled, per sequence
            staleness = (self.state.global_step - inputs["generation_step"]).float()
        norm = self.max_completion_length if aggregation == "seq-mean-token-sum-norm" else None
        recompute = self.args.anchor == "recompute"
        # a region's batch statistics (SAT) are this call's: one micro-batch per optimiser step (DPPOConfig checks it)
        token_inputs = TokenInputs(divergence=divergence, old_logp=old_logp if recompute else None, staleness=staleness)
        loss, stats = policy_loss(logp, rollout_logp, select_advantages(adv, selected), mask, self._spec, token_inputs,
                                  max_response_len=norm, denominator=denominator)
        kl = None
        if self.beta != 0.0:  # TRL's k3 estimate of KL(π‖ref), aggregated like the policy term
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * torch.exp(logp - old_logp)
            loss = loss + self.beta * aggregate(kl, mask, aggregation, max_response_len=norm, denominator=denominator)
        policy_value = loss.detach() if self._entropy_bonus_enabled else None  # TRL's "policy_loss" metric
        loss = loss / scale
        if self._entropy_bonus_enabled:
            bonus_mask = generated if entropy_mask is None else generated & entropy_mask
            loss = loss - self._entropy_bonus(entropy, bonus_mask, mode)
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_dppo(mode, logp, rollout_logp, adv, mask, unscored, stats, entropy, kl, cells, inputs,
                       off_policy=off_policy, policy_value=policy_value)
        return loss

    def _selected(self, logp, rollout_logp, adv, entropy, generated):
        """(tokens the policy term trains, or None for all; the entropy filter's mask; the off-policy mask's), as
        GRPOTrainer computes them: the entropy filter over the generation's entropy quantile (`top_entropy_quantile`),
        the sequence mask on mean log µ − log π (`off_policy_mask_threshold`)."""
        entropy_mask = off_policy = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy, generated, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            off_policy = off_policy_keep(logp, rollout_logp, adv, generated, threshold=self.off_policy_mask_threshold)
        parts = [m for m in (entropy_mask, off_policy) if m is not None]
        selected = None if not parts else parts[0] if len(parts) == 1 else parts[0] & parts[1]
        return selected, entropy_mask, off_policy

    def _entropy_bonus(self, entropy: Tensor, mask: Tensor, mode: str) -> Tensor:
        """GRPOTrainer's entropy bonus coef · H̄ / (accumulation steps), H̄ the mean entropy over `mask`; with
        `use_adaptive_entropy` the coefficient of the last optimiser step, applied while its entropy was at or below
        `entropy_target`, and updated at the end of each accumulation window from the window's entropy (all ranks)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0
        if self.use_adaptive_entropy and mode == "train":
            maskf = mask.to(entropy.dtype)
            window = torch.stack([(entropy.detach() * maskf).sum(), maskf.sum()])
            self._entropy_window_stats = window if self._entropy_window_stats is None else (
                self._entropy_window_stats + window)
            if self.accelerator.sync_gradients:  # the window's last micro-batch: one reduce and sync per step
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                args = self.args
                self.entropy_coef = next_entropy_coef(self.entropy_coef, world, target=args.entropy_target,
                                                      step=args.entropy_coef_delta, low=args.entropy_coef_min,
                                                      high=args.entropy_coef_max)
                self._last_world_entropy, self._entropy_window_stats = world, None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy_mean(entropy, mask) / accumulation

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
        mask, T = _generated(output), output["completion_ids"].size(1)
        step = self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        cells = []
        for s in range(0, ids.size(0), step):
            with _HiddenCapture(self._backbone(self.model)) as capture:
                self._get_per_token_logps_and_entropies(self.model, ids[s:s + step], attention[s:s + step], T)
            cells.append(self._topk_cells(self.model, capture.hidden, output["completion_ids"][s:s + step],
                                          output["rollout_topk_ids"][s:s + step], mask[s:s + step]))
        return torch.cat(cells)

    @torch.no_grad()
    def _log_dppo(self, mode, logp, rollout_logp, adv, mask, unscored, stats, entropy, kl, cells, inputs, *,
                  off_policy=None, policy_value=None) -> None:
        """TRL's and dppo's metrics of one micro-batch (listed in the package docstring and docs/integrations.md; the
        statistics are `dppo.metrics`'): one all-reduce of sums, one of maxima. Tokens the entropy filter or the
        off-policy mask dropped count as kept by the trust region (their advantage is 0 in the surrogate)."""
        m = rollout_logp.nan_to_num(0.0)  # unscored tokens (NaN µ) are outside `mask`: they count nowhere
        topk = {} if cells is None else {"logp_cells": cells, "rollout_cells": inputs["rollout_topk_logp"],
                                         "cells_valid": inputs["rollout_topk_valid"]}
        local = {**mismatch_stats(logp, m, mask, **topk), **masked_shares(stats["keep"], adv, mask),
                 **ratio_stats(logp, m, mask, is_cap=self.args.is_cap)}
        local["entropy"], _ = token_mean(entropy, mask)
        local["unscored_frac"], local["n_all"] = token_mean(unscored, unscored | mask)
        if kl is not None:
            local["kl"], _ = token_mean(kl, mask)
        if off_policy is not None:
            local["off_policy_masked_frac"], _ = token_mean(~off_policy, unscored | mask)
        if policy_value is not None:
            local["policy_loss"], local["n_ranks"] = policy_value.float(), torch.ones((), device=logp.device)
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
            "clip_ratio/low_mean": v["masked_neg_share"],
            "sampling/sampling_logp_difference/mean": v["abs_log_ratio_mean"],
            "sampling/sampling_logp_difference/max": v["abs_log_ratio_max"],
            "dppo/unscored_frac": v["unscored_frac"], "entropy": v["entropy"]}
        metrics.update({f"dppo/{name}": v[key] for key, name in NAMES.items() if key in v})  # dppo train's names
        for name, key in (("kl", "kl"), ("policy_loss", "policy_loss"), ("dppo/off_policy_masked_frac",
                                                                          "off_policy_masked_frac")):
            if key in v:
                metrics[name] = v[key]
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)


def _generated(batch: dict) -> Tensor:
    """[B, T] bool: the completion tokens the model generated (completion_mask less tool tokens): GRPOTrainer's mask."""
    mask = batch["completion_mask"].bool()
    return mask & batch["tool_mask"].bool() if "tool_mask" in batch else mask


def _check_alignment(completion_ids: list, values: list | None, name: str) -> None:
    """µ's invariant: one row of `values` per completion, one value (or one row of K+1 cells) per completion token."""
    if values is None:
        return
    if len(values) != len(completion_ids):
        raise RuntimeError(f"µ alignment: {name} has {len(values)} rows for {len(completion_ids)} completions")
    for row, (value, ids) in enumerate(zip(values, completion_ids)):
        if len(value) != len(ids):
            raise RuntimeError(f"µ alignment: completion {row} has {len(ids)} tokens and {len(value)} values in {name}")


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
