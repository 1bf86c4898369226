"""The statistics of a whole mini-batch that a trust region reads (`TrustRegion.batch_stats`, e.g. SAT's tail
quantile of |log π − log µ|), computed once per optimiser batch and passed to every micro-batch's loss, so the
gradient does not depend on `train.micro_batch_size` (nor, under torchrun, on the number of ranks)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dppo.loss_spec import LossSpec
from dppo.losses import batch_stat_values, batch_statistics
from dppo.train.batch import RolloutBatch
from dppo.train.distributed import Dist


def mini_batch_statistics(spec: LossSpec, batch: RolloutBatch, mb: Tensor, old, *, score: Callable,
                          micro_batch_size: int, dist: Dist, device: torch.device) -> dict[str, Tensor] | None:
    """The statistics of the mini-batch `mb` over its active tokens on every rank; None when the region reads none.
    Costs one no-grad forward of the mini-batch, micro-batch by micro-batch (`score(batch, micro, grad=False)`; the
    weights do not change inside a mini-batch, so π here is the π of every micro-batch's loss). `old`: π_old's
    scores of the batch (the recompute anchor), else None."""
    if not spec.region.batch_stats:
        return None
    parts: dict[str, list[Tensor]] = {name: [] for name in spec.region.batch_stats}
    for micro in mb.split(micro_batch_size):
        logp = score(batch, micro, grad=False).logp
        anchor = old.logp[micro] if spec.anchor == "recompute" else batch.rollout_logp[micro]
        for name, v in batch_stat_values(spec, logp, anchor, batch.loss_mask[micro]).items():
            parts[name].append(v.reshape(-1))
    values = {name: torch.cat(v) for name, v in parts.items()}
    if dist.enabled:  # every rank's values, padded to the longest rank's (NaN = no token)
        lengths = dist.all_gather_rows(torch.tensor([mb.shape[0] * batch.response_ids.shape[1]], device=device))
        width = int(lengths.max())
        values = {name: dist.all_gather_rows(
            torch.nn.functional.pad(v, (0, width - v.shape[0]), value=float("nan"))[None]).reshape(-1)
            for name, v in values.items()}
    return batch_statistics(spec, values)
