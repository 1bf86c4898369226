"""The token recorder: one row of tokens after a prompt, grown turn by turn, and the `Rollout` it becomes.

A row holds generated tokens (loss mask 1, µ = the engine's log-prob, µ's top-K cells, the weight version that
sampled each) and inserted tokens — an environment's or an agent's messages, the chat template's boundary — (mask
0, µ 0, top-K cells invalid, the previous token's version), each tagged with its turn. An environment's episode is
one row (`dppo.episodes.env_loop`); an agent's episode through the proxy is one row or several
(`dppo.episodes.agent_rows`). Both sample each turn with `turn_seed`.
"""

from __future__ import annotations

import torch

from dppo.rollout.base import Rollout

_TURN_SEED_MULT = 0x5851F42D4C957F2D


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn`: (seed + turn·m) mod 2^62 with m odd, so no turn's seed is another async
    share's (which adds 2^40) or another rank's (2^32)."""
    return None if seed is None else (seed + turn * _TURN_SEED_MULT) % (1 << 62)


class TokenRecord:
    """A growing row of tokens after `prompt_ids` (module docstring)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.mask: list[bool] = []
        self.turn: list[int] = []
        self.versions: list[int] = []
        self.cells: list = []  # per part: (ids [t, S], logp, valid) of generated tokens, or an inserted part's length
        self.stopped = True
        """Whether the last generated part ended with the EOS (else the template's end of turn is inserted)."""

    @classmethod
    def empty(cls, eos_id: int, version: int) -> "TokenRecord":
        """A row with no trained token: the EOS as its prompt and as one inserted token (an episode that sampled
        nothing still needs a row, for its reward to count in its group)."""
        out = cls([eos_id])
        out.ids, out.logp, out.mask, out.turn, out.versions, out.cells = [eos_id], [0.0], [False], [0], [version], [1]
        return out

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def inserted(self) -> int:
        """Tokens not sampled by the policy (loss mask 0)."""
        return self.mask.count(False)

    def add_generated(self, r: Rollout, turn: int, eos_id: int) -> None:
        """The tokens `r` generated, as turn `turn`."""
        n = int(r.response_ids.numel())
        self.ids += r.response_ids.tolist()
        self.logp += r.rollout_logp.tolist()
        self.mask += [True] * n
        self.turn += [turn] * n
        versions = r.token_versions if r.token_versions is not None else torch.full((n,), r.weight_version)
        self.versions += versions.tolist()
        self.cells.append((r.rollout_topk_ids, r.rollout_topk_logp, r.rollout_topk_valid)
                          if r.rollout_topk_ids is not None else n)
        self.stopped = bool(n) and int(r.response_ids[-1]) == eos_id

    def add_inserted(self, ids: list[int], turn: int) -> None:
        """Tokens the policy did not sample (an environment's answer, the template's end of turn), tagged with the
        turn they answer."""
        self.ids += ids
        self.logp += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.turn += [turn] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.cells.append(len(ids))

    def to_rollout(self, prompt_index: int, finish: str, **fields) -> Rollout:
        """The record as a `Rollout` (its weight version: the oldest generated token's); `fields` go to it."""
        mask = torch.tensor(self.mask, dtype=torch.bool)
        versions = torch.tensor(self.versions, dtype=torch.long)
        out = Rollout(prompt_index=prompt_index, prompt_ids=torch.tensor(self.prompt_ids, dtype=torch.long),
                      response_ids=torch.tensor(self.ids, dtype=torch.long),
                      rollout_logp=torch.tensor(self.logp, dtype=torch.float32), finish_reason=finish,
                      weight_version=int((versions[mask] if bool(mask.any()) else versions).min()),
                      token_versions=versions, loss_mask=mask, turn_index=torch.tensor(self.turn, dtype=torch.long),
                      **fields)
        widths = [c[0].shape[-1] for c in self.cells if isinstance(c, tuple)]
        if widths:  # µ's top-K cells of generated tokens; invalid (id 0, log-prob 0) on inserted tokens
            S = widths[0]
            parts = [c if isinstance(c, tuple) else (torch.zeros((c, S), dtype=torch.long),
                                                     torch.zeros((c, S)), torch.zeros((c, S), dtype=torch.bool))
                     for c in self.cells]
            out.rollout_topk_ids, out.rollout_topk_logp, out.rollout_topk_valid = (torch.cat(p) for p in zip(*parts))
        return out


__all__ = ["TokenRecord", "turn_seed"]
