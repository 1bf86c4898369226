"""The trainer's forward pass: log π(a_t|s_t) of sampled responses, without waste (docs/library.md, "Pure functions").

`score_responses` runs each distinct prompt of a micro-batch once for all the responses to it (G per prompt in
GRPO-style batches) and applies the lm-head only at response positions through `dppo.logprobs.fused_logprobs`
(no [N, V] float32 tensor). Gradients flow through the prompt pass too. Two layouts, the cheaper one chosen
per call (`layout="auto"`, by a FLOP estimate):

- "packed": one row per distinct prompt, `prompt, response_1, ..., response_G` without padding between them,
  position ids restarting after the prompt for every response, and a block attention mask (each response sees
  the prompt and itself, causally). Only real tokens go through the matmuls: with responses of mixed lengths
  (padded to the longest in a batch) this saves the padding, ~1/3 of the tokens of a SmolLM2 demo batch. The
  attention of a row is dense over the row, so very long rows (large G x long responses) cost more here.
- "shared": the prompts run once with a KV cache, the cache is shared by their responses, and the responses
  run padded to the longest on top of it.

`score_responses_reference` is the obviously-correct slow version (each sequence concatenated and run whole,
full log-softmax) that both layouts are tested against.
"""

from __future__ import annotations

import contextlib
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
    layout: str = "auto",
) -> Scores:
    """log π of each response token, sharing each distinct prompt's forward pass across its responses.

    prompt_ids: B tensors [P_i]; response_ids, response_mask: [B, T] (the mask a prefix of each row);
    topk_ids: [B, T, S] or None; layout: "auto", "packed" or "shared" (see the module docstring).
    """
    if layout not in ("auto", "packed", "shared"):
        raise ValueError(f"layout: expected 'auto', 'packed' or 'shared', got {layout!r}")
    device = next(model.parameters()).device
    decoder, weight = _decoder_and_head(model)
    distinct, owner = _dedupe_prompts(prompt_ids)
    response_ids = response_ids.to(device)
    response_mask = response_mask.to(device).bool()
    cpu_mask = response_mask.cpu()
    lengths = cpu_mask.sum(-1)
    prefix = bool((cpu_mask == (torch.arange(cpu_mask.shape[1])[None, :] < lengths[:, None])).all())
    if layout == "auto":
        layout = _cheaper_layout(decoder, distinct, owner, lengths, response_ids.shape[1]) if prefix else "shared"
    elif layout == "packed" and not prefix:
        raise ValueError("response_mask: the packed layout needs each row's mask to be a prefix (tokens, then padding)")
    elif layout == "packed" and not _packable(decoder):
        raise ValueError(f"layout: 'packed' needs sdpa or eager attention, not {decoder.config._attn_implementation!r}")
    if layout == "packed":
        h = _packed_hidden(decoder, distinct, owner, response_ids, lengths, pad_id)
    else:
        h = _shared_hidden(decoder, distinct, owner, response_ids, response_mask, pad_id)
    return _head(h, weight, response_ids, response_mask, topk_ids, temperature, with_entropy)


def _cheaper_layout(decoder: nn.Module, distinct: list[Tensor], owner: Tensor, lengths: Tensor, T: int) -> str:
    """"packed" unless its dense per-row attention costs more than the padding it saves. FLOPs per layer: a
    token through the linear layers costs 2 x the layer's parameters; a (query, key) pair of attention ~4 x width."""
    layers = getattr(decoder, "layers", None)
    if not layers or not _packable(decoder):
        return "shared"
    per_token = 2 * sum(p.numel() for p in layers[0].parameters())
    per_pair = 4 * getattr(decoder.config, "hidden_size", 1)
    P = torch.tensor([int(p.numel()) for p in distinct], dtype=torch.float64)
    rows = P + torch.zeros_like(P).index_add_(0, owner, lengths.double())
    packed = rows.sum() * per_token + (rows ** 2 / 2).sum() * per_pair
    B = len(owner)
    shared = (P.sum() + B * T) * per_token + (P.sum() ** 2 / 2 + B * T * (P.max() + T / 2)) * per_pair
    return "packed" if packed <= shared else "shared"


def _packable(decoder: nn.Module) -> bool:
    """The packed rows need a custom 4D attention mask, which only the sdpa and eager backends take."""
    return getattr(decoder.config, "_attn_implementation", "sdpa") in ("sdpa", "eager")


def packed_layout_supported(model: nn.Module) -> bool:
    """Whether `model` can be scored with the packed layout (its attention backend takes a 4D mask)."""
    return _packable(_decoder_and_head(model)[0])


def _packed_hidden(decoder, distinct, owner, response_ids, lengths, pad_id) -> Tensor:
    """Hidden states predicting each response token ([N, H], N = real response tokens in row-major order), from
    one packed row per distinct prompt."""
    device = response_ids.device
    U, B = len(distinct), len(owner)
    owner_l, lengths_l = owner.tolist(), lengths.tolist()
    rows: list[list[Tensor]] = [[p.to(device)] for p in distinct]
    row_len = [int(p.numel()) for p in distinct]
    seg_start = [0] * B
    for b in range(B):  # responses appended to their prompt's row, in batch order
        u, n = owner_l[b], lengths_l[b]
        seg_start[b] = row_len[u]
        rows[u].append(response_ids[b, :n])
        row_len[u] += n
    R = max(row_len)
    ids = torch.full((U, R), pad_id, dtype=torch.long, device=device)
    # segment of each position: 0 = prompt, b+1 = response b, -1 = padding; positions restart after the prompt
    seg = torch.full((U, R), -1, dtype=torch.long)
    pos = torch.zeros((U, R), dtype=torch.long)
    for u in range(U):
        ids[u, :row_len[u]] = torch.cat(rows[u])
        P = int(distinct[u].numel())
        seg[u, :P] = 0
        pos[u, :P] = torch.arange(P)
    for b in range(B):
        u, n, a = owner_l[b], lengths_l[b], seg_start[b]
        seg[u, a:a + n] = b + 1
        pos[u, a:a + n] = int(distinct[u].numel()) + torch.arange(n)
    i = torch.arange(R)
    causal = i[None, :, None] >= i[None, None, :]
    same = seg[:, :, None] == seg[:, None, :]
    sees_prompt = (seg[:, None, :] == 0) & (seg[:, :, None] >= 0)
    mask = causal & (same | sees_prompt)  # [U, R, R]: True = attend; padding attends only to padding before it
    hidden = decoder(input_ids=ids, attention_mask=mask[:, None].to(device), position_ids=pos.to(device),
                     use_cache=False).last_hidden_state
    # the state predicting response b's token t: the prompt's last position for t = 0, else its own token t-1
    row_idx, col_idx = [], []
    for b in range(B):
        u, n, a = owner_l[b], lengths_l[b], seg_start[b]
        if n:
            row_idx.append(torch.full((n,), u, dtype=torch.long))
            col_idx.append(torch.cat([torch.tensor([int(distinct[u].numel()) - 1]), torch.arange(a, a + n - 1)]))
    if not row_idx:
        return hidden.new_zeros((0, hidden.shape[-1]))
    return hidden[torch.cat(row_idx).to(device), torch.cat(col_idx).to(device)]


def _shared_hidden(decoder, distinct, owner, response_ids, response_mask, pad_id) -> Tensor:
    """Hidden states predicting each response token ([N, H], row-major), prompts run once with a shared KV cache."""
    device = response_ids.device
    p_ids, p_mask = _left_pad(distinct, pad_id)
    p_ids, p_mask, owner = p_ids.to(device), p_mask.to(device), owner.to(device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True)
    cache = out.past_key_values
    last_hidden = out.last_hidden_state[:, -1]  # [U, H]: predicts the first response token
    if len(distinct) != len(owner) or not torch.equal(owner, torch.arange(len(owner), device=device)):
        cache.batch_select_indices(owner)

    B, T = response_ids.shape
    attn = torch.cat([p_mask[owner], response_mask.long()], dim=-1)
    start = p_mask.sum(-1)[owner]  # [B] prompt lengths
    r_pos = start[:, None] + torch.arange(T, device=device)[None, :]
    r_out = decoder(input_ids=response_ids, attention_mask=attn, position_ids=r_pos, past_key_values=cache, use_cache=True)
    hidden = torch.cat([last_hidden[owner][:, None], r_out.last_hidden_state[:, :-1]], dim=1)  # [B, T, H]
    return hidden[response_mask]


def _head(h, weight, response_ids, response_mask, topk_ids, temperature, with_entropy) -> Scores:
    """The fused lm-head at the N response positions, scattered back to [B, T]."""
    device = response_ids.device
    B, T = response_ids.shape
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


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""model.precision (resolved) -> the autocast dtype of the trainer's forward/backward."""


def autocast_dtype(precision: str, weights: torch.dtype) -> torch.dtype | None:
    """The dtype `score_batch` autocasts to for a resolved `precision` with master weights of dtype `weights`:
    None when the weights already have it (bfloat16 weights compute in bf16 without autocast)."""
    dtype = AUTOCAST[precision]
    return None if dtype == weights else dtype


class ScoringModule(nn.Module):
    """`score_responses` as a module forward, so that DDP and FSDP2 hook a real forward (scoring runs the decoder
    and the lm-head weight directly, never the causal LM's own forward). `layout` is passed on."""

    def __init__(self, model: nn.Module, layout: str = "auto") -> None:
        super().__init__()
        self.model, self.layout = model, layout

    def forward(self, prompt_ids, response_ids, response_mask, **kwargs) -> Scores:
        return score_responses(self.model, prompt_ids, response_ids, response_mask, layout=self.layout, **kwargs)


def score_batch(scorer: nn.Module, batch, idx: Tensor, *, grad: bool, with_entropy: bool = False, temperature: float,
                pad_id: int, autocast: torch.dtype | None = None) -> Scores:
    """π's log-probs (and top-K cells at µ's ids, entropy) of the sequences `idx` of a `RolloutBatch`, through
    `scorer` (a `ScoringModule`, DDP/FSDP2-wrapped under torchrun), with gradient or without, under autocast to
    `autocast` (bfloat16 or float16; None = the weights' own dtype, `autocast_dtype`). Under autocast the decoder's
    matmuls run in that dtype while the residual stream, the norms and the final hidden state stay float32, so the
    fused lm-head + log-softmax (`fused_logprobs`, whose matmuls follow the hidden state's dtype) computes the
    logits and log-probs in float32: the log-probs the importance weight and the divergences read are never rounded
    to 16 bits."""
    device = next(scorer.parameters()).device
    autocast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with (contextlib.nullcontext() if grad else torch.no_grad()), autocast:
        return scorer(
            [batch.prompt_ids[i] for i in idx.tolist()], batch.response_ids[idx], batch.response_mask[idx],
            temperature=temperature, topk_ids=batch.rollout_topk_ids[idx] if batch.rollout_topk_ids is not None else None,
            with_entropy=with_entropy, pad_id=pad_id,
        )
