"""µ recording in TRL's transformers generation path: a logits processor placed last records log µ of every drawn token
(the log-softmax of the final scores `generate` samples from: after temperature, top-k/top-p/min-p and the other
processors) and µ's top-K; `_cells` lays them out as the K+1 cells (docs/library.md, "Decisions where the paper left
room"), and `TurnCells` keeps them per generated turn so that a multi-turn (tool-calling) completion gets its cells back
token by token.

One [B, V] score tensor is alive at a time (a reference, no copy), never all steps' scores.

The invariant: µ has one row per completion and one value per completion token, recorded for the completion's own
ids. `_MuRecorder.finish` checks it for every `generate` call, and says so when `generate` never ran the processors
(a wrapped or patched `generate`), rather than failing on a missing tensor.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from dppo.integrations.trl.config import check_sampling
from dppo.rollout.base import topk_cells


class MuNotRecordedError(RuntimeError):
    """`generate` returned tokens for which the µ recorder saw no scores (it never ran the logits processors)."""


class _MuRecorder(LogitsProcessor):
    """The last logits processor of a sampling `generate`: log µ of every drawn token, from the final scores that
    `generate` softmaxes and samples from, and µ's top-K. Holds one step's [B, V] scores (a reference, no copy); the
    token drawn at step t is read from `input_ids` at step t + 1, the last one in `finish`."""

    def __init__(self, k: int) -> None:
        self.k, self.scores, self.lse = k, None, None
        self.logp: list[Tensor] = []
        self.tokens: list[Tensor] = []
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
        self.tokens.append(tokens)
        self.scores = None

    def finish(self, completion: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """log µ [B, T] of `completion` [B, T] (and µ's top-K ids, log-probs [B, T, K]). Steps past T (a deferred
        stop check decodes one more) are dropped. Raises `MuNotRecordedError` when the recorder saw fewer steps than
        `completion` has tokens, and RuntimeError when its rows or tokens are not `completion`'s."""
        B, T = completion.shape
        if T == 0:
            empty = completion.new_zeros(B, 0, self.k)
            return completion.new_zeros(B, 0, dtype=torch.float32), ((empty, empty.float()) if self.k else None)
        steps = len(self.logp) + (self.scores is not None)
        if steps < T:
            raise MuNotRecordedError(
                f"µ was not recorded: generate returned {T} new tokens per row, but DPPOTrainer's µ recorder (the last "
                f"logits processor it passes to generate) ran at {steps} decoding steps. The model's generate did not "
                "run the logits processors it was given (a wrapped or patched generate, or one that decodes without "
                "them), so the law the tokens were drawn from is unknown; call the model's own generate with "
                "logits_processor passed through, or return µ from a rollout_func")
        if len(self.logp) < T:
            self._take(completion[:, len(self.logp)])
        logp, tokens = torch.stack(self.logp[:T], 1), torch.stack(self.tokens[:T], 1)
        if logp.shape != (B, T) or not torch.equal(tokens, completion):
            raise RuntimeError(f"µ alignment: the recorder saw {tuple(tokens.shape)} tokens [rows, steps] that are not "
                               f"the completion's {(B, T)} (generate reordered or replaced rows after sampling)")
        if not self.k:
            return logp, None
        return logp, (torch.stack([i for i, _ in self.top[:T]], 1), torch.stack([v for _, v in self.top[:T]], 1))


def _recording_generation(model, generation_config, k: int):
    """(config, processors, recorder) that sample exactly as `generation_config` does while `_MuRecorder` sees the
    final scores: temperature/top-k/top-p/min-p (the warpers `generate` would append after any custom processor)
    are built here in `generate`'s order, then the recorder, and switched off in the config. Decoding that does not
    draw each token from those scores is refused (`check_sampling` on the values generate would use)."""
    effective, _ = model._prepare_generation_config(generation_config)  # the values generate would use
    check_sampling(vars(effective), "generation_config", k)
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
    """The K+1 layout (`dppo.rollout.base.topk_cells`: µ's top-K, then the sampled token when not among them) as TRL's
    rollout_func contract carries it: (ids, log-probs with NaN in an unused slot)."""
    ids, cells, valid = topk_cells(tokens, logp, top_ids, top_logp)
    return ids, torch.where(valid, cells, float("nan"))


class TurnCells:
    """µ's K+1 cells of every turn generated in one generation batch, keyed by the turn's context (prompt plus
    everything before the turn), so that `assemble` can give each final completion its cells token by token.

    TRL's tool loop builds a multi-turn completion as turn 1, tool tokens, turn 2, ... (`tool_mask` 1 on the generated
    turns, 0 on the tool tokens) and may cut a turn short; each generated run of the completion is looked up by its
    context and must be a prefix of a turn recorded for that context. Tool tokens get no cells (ids 0, NaN)."""

    def __init__(self, k: int) -> None:
        self.width = k + 1
        self._turns: dict[tuple[int, ...], list[tuple[list[int], Tensor, Tensor]]] = {}

    def record(self, context: list[int], tokens: list[int], ids: Tensor, logp: Tensor) -> None:
        """One generated turn: its context ids, its tokens [n], cell ids and log-probs [n, K+1] (NaN = unused)."""
        self._turns.setdefault(tuple(context), []).append((list(tokens), ids, logp))

    def assemble(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                 tool_mask: list[list[int]] | None) -> tuple[list[Tensor], list[Tensor]]:
        """Per completion its cell ids [n, K+1] and log-probs [n, K+1] (NaN = no cell: unused slot or tool token).
        Each recorded turn is used once. RuntimeError when a generated run has no recorded turn."""
        out_ids, out_logp = [], []
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            mask = [1] * len(completion) if tool_mask is None else tool_mask[row]
            if len(mask) != len(completion):
                raise RuntimeError(f"µ alignment: completion {row} has {len(completion)} tokens and a tool mask of "
                                   f"{len(mask)}")
            ids, logp = self._empty(len(completion))
            for start, end in _runs(mask):
                turn_ids, turn_logp = self._pop(list(prompt) + list(completion[:start]), completion[start:end], row)
                ids[start:end], logp[start:end] = turn_ids, turn_logp
            out_ids.append(ids)
            out_logp.append(logp)
        return out_ids, out_logp

    def _empty(self, n: int) -> tuple[Tensor, Tensor]:
        return torch.zeros(n, self.width, dtype=torch.long), torch.full((n, self.width), float("nan"))

    def _pop(self, context: list[int], tokens: list[int], row: int) -> tuple[Tensor, Tensor]:
        candidates = self._turns.get(tuple(context), [])
        for i, (recorded, ids, logp) in enumerate(candidates):
            if recorded[:len(tokens)] == list(tokens):
                candidates.pop(i)
                return ids[:len(tokens)], logp[:len(tokens)]
        raise RuntimeError(f"µ alignment: the {len(tokens)} generated tokens of completion {row} that follow "
                           f"{len(context)} context tokens match no turn whose µ cells were recorded")


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of 1s in `mask`."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs
