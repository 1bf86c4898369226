"""The `hf` engine: batched sampling with plain transformers; the reference engine and the CPU fallback.

How it samples (one `generate` call):
- Prompts (token ids, or chat messages put through the tokenizer's chat template with
  ``add_generation_prompt=True``) are LEFT-padded; position ids count real tokens only, so a prompt's
  logits do not depend on what it is batched with. Each distinct prompt's prefill runs ONCE (identical
  prompts in a call included) and its KV cache is shared by all its rows (`n` per occurrence); the lm-head
  runs on the last position only. The KV cache is preallocated for prompt + max_new_tokens positions, so
  decoding writes in place instead of concatenating every layer's cache at every step.
- Each step draws the next token by inverse-CDF sampling from softmax(logits.float() / temperature), and
  records that token's log-prob (and µ's top-K) from the SAME float32 tensor, so `rollout_logp` is exactly the
  log-prob of the distribution sampled from.
- Randomness is per row: response r (= prompt_index * n + j) uses one uniform per step from its own
  `torch.Generator`, seeded from (call seed, r). A response therefore does not depend on which other prompts
  are in the call, nor on their lengths (padding cannot leak into results), and the same seed gives the same
  rollouts. The call seed is `params.seed`, or else the next draw of the engine's generator (seeded at
  construction), so successive calls differ but a run is reproducible.
- A row ends at its first EOS (tokenizer / generation-config EOS) or `stop_token_ids` token, which is kept.
  Every few steps finished rows are dropped from the batch (and its cache); the loop ends when none is left.
- top_p / top_k / min_p (without top-K capture) are supported: tokens outside the truncated set get probability 0 and
  `rollout_logp` is the log-prob under the truncated, renormalised distribution that was actually sampled; each
  token's kept-set size is recorded (`Rollout.rollout_kept_size`: those at ≥ min_p × the top probability, the top_k
  largest of them, then the smallest prefix whose mass reaches top_p), for the trainer's replay (`dppo.kept_set`; issue 62).

Prefix cache (off unless `enable_prefix_cache(max_tokens)`; multi-turn episodes turn it on): the KV of every
sequence a call generated (its prompt and response, up to the last token fed) is kept, by token ids, and a later
prompt that extends one (the next turn of an episode: the same ids plus the environment's answer) prefills only
its new tokens on top of it. Least recently used sequences are dropped past `max_tokens` cached positions; new
weights clear it. Only models whose layers are all full attention use it.

The engine holds its own copy of the weights (in `dtype` if given, else the model's dtype);
`load_weights` copies new weights into it in place and increments `weight_version`. With `between_chunks` set
(in-flight weight updates of an asynchronous rollout worker), new weights can arrive between decode chunks; the
engine then recomputes the unfinished responses' KV cache under them and records each token's weight version.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from collections import OrderedDict
from copy import deepcopy as copy_module

import torch
from torch import Tensor, nn

from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from dppo.rollout.base import EnginePrompt, Rollout, SamplingParams, prompt_token_ids, topk_cells
from dppo.runtime import models

_CHECK_EVERY = 8
"""Decode steps between checks for finished rows (one host sync each)."""
_MASK64 = (1 << 64) - 1


class HFEngine:
    """Rollout engine on a transformers causal LM (see the module docstring for how it samples).

    model: an `nn.Module` or a name/path for `dppo.runtime.models.load_model`. tokenizer: needed for chat-message
        prompts and for EOS/pad ids (if None and `model` is a name/path, it is loaded from there). dtype: the
        engine's weight dtype (default: the model's, or float32 for a name/path). seed: seeds the engine's
        generator. max_batch_rows: largest number of responses decoded together (whole prompts per batch;
        bounds KV-cache memory); None = all at once. copy: when `model` is a module, sample from a deep copy
        (default), so the caller's module is never modified; False uses the module itself (cast to `dtype`,
        put in eval mode, parameters no longer requiring grad), saving memory when the caller made a copy.

    Attributes: `model` (the engine's own module), `tokenizer`, `max_logprobs` (= vocab size), `weight_version`,
    `eos_ids` (ids that end a response; read at every `generate`, so emptying it makes every response exactly
    max_new_tokens long, as benchmarks do), `pad_id`, `max_context` (the model's max_position_embeddings).
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        tokenizer=None,
        *,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        max_batch_rows: int | None = None,
        copy: bool = True,
    ) -> None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(model, nn.Module):
            if copy:
                model = copy_module(model)
            if dtype is not None:
                model.to(dtype)
        else:
            if tokenizer is None:
                tokenizer = models.load_tokenizer(model)
            model = models.load_model(model, dtype=dtype or torch.float32)
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows: expected >= 1 or None, got {max_batch_rows}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.weight_version = 0
        self.between_chunks: Callable[[], bool] | None = None
        """In-flight weight updates: called every 8 decoded tokens; when it returns True it has loaded new weights
        (via `load_weights`), and the engine recomputes the KV cache of every unfinished response under them, so
        each later token is sampled from the new weights' exact distribution (`Rollout.token_versions` says
        which weights sampled each token)."""
        self._prefix: _PrefixCache | None = None
        self.max_logprobs = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self._generator = torch.Generator().manual_seed(seed)
        self.eos_ids = _eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError("tokenizer: no EOS token id found in the tokenizer or the model's generation config")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids)


    @classmethod
    def from_spec(cls, spec) -> "HFEngine":
        """The engine of a `dppo.rollout.spec.EngineSpec` whose settings are `dppo.rollout.settings.HFSettings`: the
        spec's model in the engine dtype on its device."""
        dtype = getattr(torch, spec.dtype)
        model, tokenizer, _ = models.load(spec.model, dtype=dtype)
        return cls(model.to(spec.device), tokenizer, dtype=dtype, seed=spec.seed, copy=False,
                   max_batch_rows=spec.settings.max_batch_rows or None)
    def enable_prefix_cache(self, max_tokens: int) -> None:
        """Keep the KV of generated sequences (up to `max_tokens` positions) for prompts that extend them; 0 = off."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens: expected >= 0, got {max_tokens}")
        full = all(t == "full_attention" for t in getattr(self.model.config.get_text_config(decoder=True),
                                                           "layer_types", None) or ["full_attention"])
        self._prefix = _PrefixCache(max_tokens) if max_tokens and full else None

    # --- the Engine protocol -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        """Sample `params.n` responses per prompt; returns len(prompts) * n rollouts, prompt-major."""
        prompt_ids = self._validate(prompts, params)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._generator))
        stop_ids = torch.tensor(sorted(self.eos_ids | set(params.stop_token_ids)), device=self.device)
        per_batch = len(prompts) if self.max_batch_rows is None else max(1, self.max_batch_rows // params.n)
        rollouts: list[Rollout] = []
        for start in range(0, len(prompt_ids), per_batch):
            chunk = prompt_ids[start : start + per_batch]
            rows = range(start * params.n, (start + len(chunk)) * params.n)
            uniforms = _row_uniforms(seed, rows, params.max_new_tokens)
            with torch.no_grad():
                out = self._sample(chunk, params, uniforms.to(self.device), stop_ids)
            rollouts += self._to_rollouts(chunk, start, params, out, stop_ids)
        return rollouts

    def load_weights(self, weights: Mapping[str, Tensor] | nn.Module) -> None:
        """Copy weights (a state dict with HF parameter names, or a module) into the engine's model in place.

        Names may carry a ``module.`` or ``_orig_mod.`` prefix (DDP, torch.compile). A subset of the
        parameters may be given; an unknown name or a shape mismatch raises ValueError before anything is
        copied. Values are cast to the engine's dtype. Increments `weight_version`.
        """
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        own = self.model.state_dict()
        pairs = []
        for name, value in weights.items():
            key = _strip_prefixes(name, own)
            if key is None:
                raise ValueError(f"weights: unknown parameter name {name!r} for this model")
            if tuple(own[key].shape) != tuple(value.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(value.shape)}, expected {tuple(own[key].shape)}")
            pairs.append((own[key], value))
        with torch.no_grad():
            for dst, src in pairs:
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        self.weight_version += 1
        if self._prefix is not None:  # cached KV was computed by the old weights
            self._prefix.clear()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Drop the model (the engine cannot generate afterwards)."""
        self.model = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- internals ------------------------------------------------------------------------------------------

    def _validate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[list[int]]:
        """Token ids of every prompt; ValueError (naming the parameter) for anything that cannot be generated."""
        if self.model is None:
            raise ValueError("engine: closed")
        return prompt_token_ids(prompts, params, tokenizer=self.tokenizer, vocab_size=self.max_logprobs,
                                max_logprobs=self.max_logprobs, max_context=self.max_context)

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams, uniforms: Tensor, stop_ids: Tensor):
        """Decode one batch. Returns tokens [B, T], logp [B, T], (top-K ids, logp) [B, T, K] or None, the token
        versions [B, T] and the kept sets' sizes [B, T] (None without truncation)."""
        model, device, T, K = self.model, self.device, params.max_new_tokens, params.top_k_logprobs
        B = len(prompt_ids) * params.n
        logits, cache, attn = self._prefill(prompt_ids, params.n, capacity_extra=T)
        next_pos = attn.sum(-1, keepdim=True)
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=device)
        logp = torch.zeros((B, T), dtype=torch.float32, device=device)
        topk_ids = torch.zeros((B, T, K), dtype=torch.long, device=device) if K else None
        topk_logp = torch.zeros((B, T, K), dtype=torch.float32, device=device) if K else None
        kept = torch.zeros((B, T), dtype=torch.long, device=device) if _truncates(params) else None
        rows = torch.arange(B, device=device)  # original row of each active row
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        versions = torch.full((B, T), self.weight_version, dtype=torch.long, device=device)
        for t in range(T):
            tok, tok_logp, top, kept_now = _sample_step(logits, uniforms[rows, t], params)
            tokens[rows, t], logp[rows, t] = tok, tok_logp
            if K:
                topk_ids[rows, t], topk_logp[rows, t] = top
            if kept is not None:
                kept[rows, t] = kept_now
            finished |= torch.isin(tok, stop_ids)
            if t == T - 1:
                break
            if (t + 1) % _CHECK_EVERY == 0:
                done = int(finished.sum())
                if done == len(rows):
                    break
                if done > 0:  # drop finished rows from the batch and its cache
                    if self._prefix is not None:
                        self._save(prompt_ids, params.n, rows, finished, cache, attn, tokens, stop_ids, fed=t)
                    keep = (~finished).nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
                    finished = finished[keep]
                if self.between_chunks is not None and self.between_chunks():  # new weights: rebuild the cache
                    versions[rows, t + 1:] = self.weight_version
                    logits, cache, attn = self._reprefill(prompt_ids, params.n, rows, tokens[rows, :t + 1], T - t - 1)
                    next_pos = attn.sum(-1, keepdim=True)
                    continue
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=cache,
                        use_cache=True)
            logits, cache = out.logits[:, -1], out.past_key_values
            next_pos = next_pos + 1
        if self._prefix is not None:
            self._save(prompt_ids, params.n, rows, torch.ones_like(finished), cache, attn, tokens, stop_ids, fed=t)
        return tokens, logp, (topk_ids, topk_logp) if K else None, versions, kept

    def _save(self, prompt_ids, n: int, rows: Tensor, which: Tensor, cache, attn: Tensor, tokens: Tensor,
              stop_ids: Tensor, *, fed: int) -> None:
        """Keep the KV of the active rows `which` (prompt + response up to its last token fed: `fed` tokens of each
        row were fed so far, the response ends at its first stop token) in the prefix cache."""
        for i in which.nonzero().squeeze(1).tolist():
            r = int(rows[i])
            stop = torch.isin(tokens[r, :fed + 1], stop_ids).nonzero()
            keep = int(stop[0]) if len(stop) else fed  # the response's tokens but its last (whose KV is not computed)
            seq = tuple(prompt_ids[r // n]) + tuple(tokens[r, :keep].tolist())
            real = attn[i].bool()
            kv = [(layer.keys[i][:, real][:, :len(seq)].clone(), layer.values[i][:, real][:, :len(seq)].clone())
                  for layer in cache.layers]
            if kv and kv[0][0].shape[1] == len(seq):
                self._prefix.store(seq, kv)

    def _reprefill(self, prompt_ids: list[list[int]], n: int, rows: Tensor, generated: Tensor, extra: int):
        """The last logits, KV cache and attention mask of the responses `rows` (prompt + `generated` so far),
        computed afresh by the current weights: one left-padded forward."""
        seqs = [prompt_ids[r // n] + g for r, g in zip(rows.tolist(), generated.tolist())]
        return self._forward_left_padded(seqs, extra)

    def _prefill(self, prompt_ids: list[list[int]], n: int, *, capacity_extra: int):
        """One left-padded forward over the DISTINCT prompts; returns the last-position logits [B, V], the KV
        cache and the attention mask [B, L], expanded to the B = len(prompt_ids) * n rows (prompt-major)."""
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]
        hits = [self._prefix.lookup(p) for p in distinct] if self._prefix is not None else []
        if any(h is not None for h in hits):
            logits, cache, attn = self._forward_on_prefixes([list(p) for p in distinct], hits, capacity_extra)
        else:
            logits, cache, attn = self._forward_left_padded([list(p) for p in distinct], capacity_extra)
        row_source = torch.tensor(source, device=self.device).repeat_interleave(n)
        cache.batch_select_indices(row_source)  # rows share their prompt's prefill
        return logits[row_source], cache, attn[row_source]

    def _forward_left_padded(self, seqs: list[list[int]], capacity_extra: int):
        """One forward over `seqs` left-padded to a common length L, into a KV cache with room for `capacity_extra`
        more positions; returns the last-position logits [N, V], the cache and the attention mask [N, L]."""
        L = max(len(q) for q in seqs)
        input_ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, q in enumerate(seqs):
            input_ids[i, L - len(q):] = torch.tensor(q)
            attn[i, L - len(q):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0 whatever the padding
        cache = _make_cache(self.model, capacity=L + capacity_extra)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.past_key_values, attn

    def _forward_on_prefixes(self, seqs: list[list[int]], hits: list, capacity_extra: int):
        """Like `_forward_left_padded`, but each sequence with a cached prefix (hits[i] = its KV per layer) runs only
        its new tokens on top of it. Layout of row i: [pad, cached prefix (c_i)] [pad, new tokens (s_i)], padding
        masked out and positions counting real tokens, so the logits are those of the whole sequence."""
        N, device = len(seqs), self.device
        cached = [0 if h is None else h[0][0].shape[1] for h in hits]
        C, S = max(cached), max(len(q) - c for q, c in zip(seqs, cached))
        cache = _make_cache(self.model, capacity=C + S + capacity_extra)
        ref = next(h for h in hits if h is not None)[0]
        for layer in range(len(cache.layers)):
            k = ref[0].new_zeros((N,) + ref[0].shape[:1] + (C,) + ref[0].shape[2:])
            v = ref[1].new_zeros((N,) + ref[1].shape[:1] + (C,) + ref[1].shape[2:])
            for i, h in enumerate(hits):
                if h is not None:
                    k[i, :, C - cached[i]:], v[i, :, C - cached[i]:] = h[layer]
            cache.layers[layer].update(k.to(device), v.to(device))
        input_ids = torch.full((N, S), self.pad_id, dtype=torch.long)
        positions = torch.zeros((N, S), dtype=torch.long)
        attn = torch.zeros((N, C + S), dtype=torch.long)
        for i, (q, c) in enumerate(zip(seqs, cached)):
            new = q[c:]
            input_ids[i, S - len(new):] = torch.tensor(new)
            positions[i, S - len(new):] = torch.arange(c, c + len(new))
            attn[i, C - c:C] = 1
            attn[i, C + S - len(new):] = 1
        input_ids, positions, attn = input_ids.to(device), positions.to(device), attn.to(device)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.past_key_values, attn

    def _to_rollouts(self, prompt_ids, start, params, out, stop_ids) -> list[Rollout]:
        """Cut each row at its first stop token and build the Rollout objects (one host transfer)."""
        tokens, logp, top, versions, kept = out
        T = tokens.shape[1]
        kept = kept.cpu() if kept is not None else None
        versions = versions.cpu()
        is_stop = torch.isin(tokens, stop_ids)
        lengths = torch.where(is_stop.any(-1), is_stop.int().argmax(-1) + 1, T)
        last = tokens.gather(1, (lengths - 1)[:, None])[:, 0]
        tokens, logp, lengths, last = tokens.cpu(), logp.cpu(), lengths.tolist(), last.tolist()
        if top is not None:
            topk_ids, topk_logp, topk_valid = topk_cells(tokens, logp, top[0].cpu(), top[1].cpu())
        eos = self.eos_ids
        prompts = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
        rollouts = []
        for b, (length, last_tok) in enumerate(zip(lengths, last)):
            if length < T or last_tok in eos or last_tok in params.stop_token_ids:
                reason = "eos" if last_tok in eos else "stop"
            else:
                reason = "length"
            rollouts.append(
                Rollout(
                    prompt_index=start + b // params.n,
                    prompt_ids=prompts[b // params.n],
                    response_ids=tokens[b, :length].clone(),
                    rollout_logp=logp[b, :length].clone(),
                    finish_reason=reason,
                    weight_version=int(versions[b, 0]),
                    token_versions=versions[b, :length].clone(),
                    rollout_topk_ids=topk_ids[b, :length].clone() if top is not None else None,
                    rollout_topk_logp=topk_logp[b, :length].clone() if top is not None else None,
                    rollout_topk_valid=topk_valid[b, :length].clone() if top is not None else None,
                    rollout_kept_size=kept[b, :length].clone() if kept is not None else None,
                )
            )
        return rollouts


class _PrefixCache:
    """KV of generated sequences by token ids (per layer (keys, values) [H, L, D]), least recently used dropped past
    `max_tokens` positions."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.tokens = max_tokens, 0
        self.entries: OrderedDict[tuple[int, ...], list[tuple[Tensor, Tensor]]] = OrderedDict()

    def lookup(self, ids: tuple[int, ...]):
        """The KV of the longest cached sequence that is a proper prefix of `ids`, or None."""
        best = None
        for seq in self.entries:
            if len(seq) < len(ids) and (best is None or len(seq) > len(best)) and ids[:len(seq)] == seq:
                best = seq
        if best is None:
            return None
        self.entries.move_to_end(best)
        return self.entries[best]

    def store(self, seq: tuple[int, ...], kv: list[tuple[Tensor, Tensor]]) -> None:
        if not seq or len(seq) > self.max_tokens:
            return
        if seq in self.entries:
            self.entries.move_to_end(seq)
            return
        self.entries[seq] = kv
        self.tokens += len(seq)
        while self.tokens > self.max_tokens:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


def _make_cache(model: nn.Module, capacity: int):
    """A KV cache preallocated for `capacity` positions when every layer is full attention, else a DynamicCache."""
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return DynamicCache(config=model.config)
    return Cache(layers=[_PreallocatedLayer(capacity) for _ in range(n_layers)])


class _PreallocatedLayer(DynamicLayer):
    """A KV-cache layer that writes into buffers preallocated for `capacity` positions (grown by doubling)
    instead of concatenating new tensors at every step; `keys`/`values` are views of the filled part."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self._k = key_states.new_empty((B, H, self.capacity, D))
        self._v = value_states.new_empty((B, H, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._resize(torch.arange(self._k.shape[0], device=self._k.device), max(end, 2 * self._k.shape[-2]))
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length > 0:
            rows = torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats)
            self._resize(rows, self._k.shape[-2])

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.length > 0:
            self._resize(indices, self._k.shape[-2])

    def _resize(self, rows: Tensor, capacity: int) -> None:
        """New buffers holding the filled part of `rows`, with room for `capacity` positions."""
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty((len(rows), old.shape[1], capacity, old.shape[3]))
            new[:, :, : self.length] = old[rows, :, : self.length]
            setattr(self, name, new)
        self._refresh()

    def _refresh(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]


def _truncates(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _sample_step(logits: Tensor, u: Tensor, params: SamplingParams):
    """Draw one token per row from softmax(logits / τ) (truncated by top_k/top_p) by inverse CDF at u [b].

    Returns (tokens [b], their log-probs [b], (top-K ids, log-probs) [b, K] or None, the kept set's size [b] or None
    without truncation), all from the same float32 log-softmax that defines the sampled distribution (µ_S: the
    truncated, renormalised one; the tokens outside the kept set have log-prob -inf).
    """
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    scaled = _truncate(scaled, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    logp_all = scaled.log_softmax(-1)
    cdf = logp_all.exp().cumsum(-1)
    total = cdf[:, -1:]
    # u * total < total, so the first index with cdf > x has positive probability (zero-mass tokens are skipped)
    x = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = torch.searchsorted(cdf, x, right=True).clamp_(max=logits.shape[-1] - 1)
    tok_logp = logp_all.gather(-1, tok)[:, 0]
    top = None
    if params.top_k_logprobs:
        values, ids = logp_all.topk(params.top_k_logprobs, dim=-1, sorted=True)
        top = (ids, values)
    kept = torch.isfinite(logp_all).sum(-1) if _truncates(params) else None
    return tok[:, 0], tok_logp, top, kept


def _truncate(scaled: Tensor, *, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """Set logits below min_p × the top probability, then outside the top-k, then outside the top-p nucleus, to
    -inf (vLLM's order; always keeps the argmax)."""
    if min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs > top_p  # mass before this token already exceeds top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _row_uniforms(seed: int, rows: range, steps: int) -> Tensor:
    """[len(rows), steps] float32 uniforms; row r's values depend only on (seed, r)."""
    out = torch.empty((len(rows), steps), dtype=torch.float32)
    g = torch.Generator()
    for i, r in enumerate(rows):
        g.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ r) >> 1)
        out[i] = torch.rand(steps, generator=g)
    return out


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tok_eos, gen_eos):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return {int(i) for i in ids}


def _strip_prefixes(name: str, own: Mapping[str, Tensor]) -> str | None:
    """The engine's parameter name for `name`, allowing DDP/compile wrapper prefixes; None if unknown."""
    while name not in own:
        for prefix in ("module.", "_orig_mod."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        else:
            return None
    return name
