"""The trainer's forward pass: log π(a_t|s_t) of sampled responses, without waste (spec §7 step 3).

`score_responses` runs each distinct prompt of a micro-batch once, shares its KV cache across all the
responses to it (G per prompt in GRPO-style batches), runs the responses on top of that cache, and applies
the lm-head only at response positions through `dppo.logprobs.fused_logprobs` (no [N, V] float32 tensor).
Gradients flow through the prompt pass too. `score_responses_reference` is the obviously-correct slow
version (each sequence concatenated and run whole, full log-softmax) that the fast path is tested against.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor, nn

from dppo.logprobs import fused_logprobs, gather_logprobs_from_logits, entropy_from_logits, logprobs_from_logits


class Scores(NamedTuple):
    logp: Tensor
    """[B, T] float32 log π(a_t|s_t) with gradient (0 at padding)."""
    topk_logp: Tensor | None
    """[B, T, S] float32 π's log-probs at µ's top-K cells, detached (None if not requested)."""
    entropy: Tensor | None
    """[B, T] float32 entropy of π, detached (None if not requested)."""


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, Tensor]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("model: expected a causal LM with a bias-free output embedding (lm_head)")
    return base.get_decoder(), head.weight


def _dedupe_prompts(prompt_ids: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Distinct prompts (first occurrence order) and, per sequence, the index of its prompt."""
    index: dict[tuple[int, ...], int] = {}
    distinct: list[Tensor] = []
    owner = []
    for p in prompt_ids:
        key = tuple(p.tolist())
        if key not in index:
            index[key] = len(distinct)
            distinct.append(p)
        owner.append(index[key])
    return distinct, torch.tensor(owner, dtype=torch.long)


def _left_pad(seqs: Sequence[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    length = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = int(s.numel())
        if n:
            ids[i, length - n:] = s
            mask[i, length - n:] = 1
    return ids, mask


def score_responses(
    model: nn.Module,
    prompt_ids: Sequence[Tensor],
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    topk_ids: Tensor | None = None,
    with_entropy: bool = False,
    pad_id: int = 0,
) -> Scores:
    """log π of each response token, sharing each distinct prompt's forward pass across its responses.

    prompt_ids: B tensors [P_i]; response_ids, response_mask: [B, T]; topk_ids: [B, T, S] or None.
    """
    device = next(model.parameters()).device
    decoder, weight = _decoder_and_head(model)
    distinct, owner = _dedupe_prompts(prompt_ids)
    p_ids, p_mask = _left_pad(distinct, pad_id)
    p_ids, p_mask, owner = p_ids.to(device), p_mask.to(device), owner.to(device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True)
    cache = out.past_key_values
    last_hidden = out.last_hidden_state[:, -1]  # [U, H]: predicts the first response token
    if len(distinct) != len(prompt_ids) or not torch.equal(owner, torch.arange(len(owner), device=device)):
        cache.batch_select_indices(owner)

    response_ids = response_ids.to(device)
    response_mask = response_mask.to(device).bool()
    B, T = response_ids.shape
    attn = torch.cat([p_mask[owner], response_mask.long()], dim=-1)
    start = p_mask.sum(-1)[owner]  # [B] prompt lengths
    r_pos = start[:, None] + torch.arange(T, device=device)[None, :]
    r_out = decoder(input_ids=response_ids, attention_mask=attn, position_ids=r_pos, past_key_values=cache, use_cache=True)
    hidden = torch.cat([last_hidden[owner][:, None], r_out.last_hidden_state[:, :-1]], dim=1)  # [B, T, H]

    h = hidden[response_mask]
    w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
    sel_topk = topk_ids.to(device)[response_mask] if topk_ids is not None else None
    fused = fused_logprobs(h, w, response_ids[response_mask], topk_ids=sel_topk, temperature=temperature,
                           with_entropy=with_entropy)
    logp = torch.zeros((B, T), dtype=torch.float32, device=device).masked_scatter(response_mask, fused.logp.float())
    topk_logp = entropy = None
    if topk_ids is not None:
        topk_logp = torch.zeros(topk_ids.shape, dtype=torch.float32, device=device)
        topk_logp[response_mask] = fused.topk_logp.float()
    if with_entropy:
        entropy = torch.zeros((B, T), dtype=torch.float32, device=device)
        entropy[response_mask] = fused.entropy.float()
    return Scores(logp, topk_logp, entropy)


def score_responses_reference(
    model: nn.Module,
    prompt_ids: Sequence[Tensor],
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    topk_ids: Tensor | None = None,
    with_entropy: bool = False,
) -> Scores:
    """Slow reference: each prompt+response run alone through the whole model, full log-softmax."""
    B, T = response_ids.shape
    device = next(model.parameters()).device
    logps, topks, ents = [], [], []
    for b in range(B):
        n = int(response_mask[b].sum())
        seq = torch.cat([prompt_ids[b], response_ids[b, :n].cpu()]).to(device)[None]
        logits = model(input_ids=seq).logits[0, prompt_ids[b].numel() - 1 : -1]  # [n, V]
        row = torch.zeros(T, device=device)
        row[:n] = logprobs_from_logits(logits, seq[0, prompt_ids[b].numel():], temperature=temperature)
        logps.append(row)
        if topk_ids is not None:
            t = torch.zeros(topk_ids.shape[1:], device=device)
            t[:n] = gather_logprobs_from_logits(logits, topk_ids[b, :n].to(device), temperature=temperature).detach()
            topks.append(t)
        if with_entropy:
            e = torch.zeros(T, device=device)
            e[:n] = entropy_from_logits(logits, temperature=temperature).detach()
            ents.append(e)
    return Scores(
        torch.stack(logps),
        torch.stack(topks) if topk_ids is not None else None,
        torch.stack(ents) if with_entropy else None,
    )
