"""µ recording in TRL's transformers generation path: a logits processor placed last records log µ of every drawn
token (the log-softmax of the final scores `generate` samples from: after temperature, top-k/top-p/min-p and the
other processors) and µ's top-K, and `_cells` lays them out as the K+1 cells of spec §2.

One [B, V] score tensor is alive at a time (a reference, no copy), never all steps' scores.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from dppo.rollout.base import topk_cells


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
    """The K+1 layout of spec §2 (`dppo.rollout.base.topk_cells`: µ's top-K, then the sampled token when not among
    them) as TRL's rollout_func contract carries it: (ids, log-probs with NaN in an unused slot)."""
    ids, cells, valid = topk_cells(tokens, logp, top_ids, top_logp)
    return ids, torch.where(valid, cells, float("nan"))
