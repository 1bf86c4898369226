"""Log-probabilities of sampled tokens without materialising float32 [N, V] tensors.

Plain helpers (`logprobs_from_logits`, `gather_logprobs_from_logits`, `topk_logprobs_from_logits`,
`entropy_from_logits`) are used by the engines on logits they already hold; `fused_logprobs` (lm-head +
log-softmax + gather, tiled, recomputed in backward; defined in `dppo.fused_logprobs`, re-exported here) is
what the trainer uses. The naive spec every helper matches is
`torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo.fused_logprobs import FusedLogprobs, fused_logprobs

__all__ = [
    "FusedLogprobs",
    "entropy_from_logits",
    "fused_logprobs",
    "gather_logprobs_from_logits",
    "logprobs_from_logits",
    "topk_logprobs_from_logits",
]


def logprobs_from_logits(logits: Tensor, ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[..., ids] computed in float32.

    logits [..., V], ids [...] (one id per row) -> [...] float32.
    Equivalent to `torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[..., None])[..., 0]`
    but only the gathered value and a logsumexp are formed in float32.
    """
    if ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids: expected shape {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    picked = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def gather_logprobs_from_logits(logits: Tensor, ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at several ids per row: logits [..., V], ids [..., S] -> [..., S]."""
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids: expected leading shape {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def topk_logprobs_from_logits(logits: Tensor, k: int, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The k most likely ids of softmax(logits / temperature) and their log-probs, sorted descending.

    logits [..., V] -> (ids [..., k] int64, logp [..., k] float32).
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k: expected 1 <= k <= vocab size {logits.shape[-1]}, got {k}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    values, ids = scaled.topk(k, dim=-1, sorted=True)
    return ids, values - torch.logsumexp(scaled, dim=-1, keepdim=True)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) in float32: logits [..., V] -> [...]."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)
