"""`dppo_rollout_func`: a TRL `rollout_func` that samples with a dppo engine ("hf", "vllm" or an `Engine`) and
returns µ's K+1 cells per token (TRL 1.16's rollout_func contract), which the Top-K trust regions need and TRL's own
vLLM path does not keep.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from accelerate.utils import is_peft_model

from dppo.rollout.base import SamplingParams
from dppo.rollout.hf import HFEngine

__all__ = ["DPPORolloutFunc", "dppo_rollout_func"]


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
        out["logprobs"] = [torch.where(r.rollout_topk_valid, r.rollout_topk_logp, float("nan")).tolist()
                           for r in rollouts]
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
