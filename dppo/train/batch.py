"""The rollout batch the trainer works on: rollouts collated into right-padded [B, T] tensors.

Shapes (B = P·G responses, prompt-major with each prompt's G responses contiguous; T = the longest response;
K+1 = µ's top-K plus the sampled token's slot):

- `prompt_ids`: B tensors [P_i] int64 (unpadded; equal prompts share one tensor)
- `prompt_index`: [B] int64, the prompt of each response within the step
- `response_ids` [B, T] int64 (padded with pad_id), `response_mask` [B, T] bool (True = real token, a prefix)
- `loss_mask` [B, T] bool: True = a token the policy sampled (the loss, its denominator and the metrics count these);
  equal to `response_mask` for single-turn responses, False on a multi-turn episode's environment tokens
- `rollout_logp` [B, T] float32: log µ(a_t|s_t) recorded by the engine (0 at padding and on environment tokens)
- `weight_version` [B] int64: the engine weights each response was sampled under (started under)
- `token_version` [B, T] int64: the weights of each token, where the engine records it
- `turn_index` [B, T] int64: the assistant turn of each token (episodes only; -1 at padding)
- `episode` [B] int64: each row's episode (= the row, but for an agent's multi-row episodes,
  `dppo.episodes.results.row_episodes`); rewards and advantages come per episode and are read through it
- `engine` [B] int64: the fleet member that sampled each row (`Rollout.engine`; 0 for a single engine)
- `staleness` [B], `token_staleness` [B, T] int64: set by `stamp_staleness` for the step that trains on the batch;
  `reward` [B] float: each row's episode reward, set by the trainer (the ledger's surrogate)
- `topk_ids`, `topk_logp`, `topk_valid` [B, T, K+1]: µ's top-K cells (None without top-K capture)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dppo.episodes.results import row_episodes
from dppo.losses import TokenInputs
from dppo.rollout.base import Rollout


@dataclass
class RolloutBatch:
    """Rollouts collated into right-padded [B, T] tensors (B = responses, T = longest response)."""

    prompt_ids: list[Tensor]
    """B tensors [P_i] int64 (unpadded: prompts differ in length; equal prompts are shared by reference)."""
    prompt_index: Tensor
    """[B] int64."""
    response_ids: Tensor
    """[B, T] int64, padded with `pad_id`."""
    response_mask: Tensor
    """[B, T] bool, True = real response token."""
    rollout_logp: Tensor
    """[B, T] float32, 0 at padding."""
    finish_reason: list[str]
    weight_version: Tensor
    """[B] int64."""
    loss_mask: Tensor | None = None
    """[B, T] bool, True = sampled by the policy (see the module docstring); None is filled with response_mask."""
    rollout_topk_ids: Tensor | None = None
    """[B, T, K+1] int64 or None."""
    rollout_topk_logp: Tensor | None = None
    """[B, T, K+1] float32 or None."""
    rollout_topk_valid: Tensor | None = None
    """[B, T, K+1] bool or None (False at padding)."""
    episode: Tensor | None = None
    """[B] int64: each row's episode (`collate` sets it; None in a batch made by hand: a row is an episode)."""
    engine: Tensor | None = None
    """[B] int64: the fleet member that sampled each row."""
    turn_index: Tensor | None = None
    """[B, T] int64: the assistant turn of each token (-1 at padding); None outside multi-turn episodes."""
    token_version: Tensor | None = None
    """[B, T] int64: the weight version of each token, where the engine records it."""
    staleness: Tensor | None = None
    """[B] int64: optimiser steps between each response's weights and the step training on it (`stamp_staleness`)."""
    token_staleness: Tensor | None = None
    """[B, T] int64: the same per token, where `token_version` is recorded."""
    reward: Tensor | None = None
    """[B] float: each row's episode reward (set by the trainer once the rewards are in)."""

    TAGS = ("episode", "engine", "turn_index", "token_version", "staleness", "token_staleness", "reward")
    """The per-row and per-token tags above: moved with the batch (`to`)."""

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask
        elif bool((self.loss_mask & ~self.response_mask).any()):
            raise ValueError("loss_mask: True outside response_mask (a trained token must be a real token)")

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """A copy with every tensor on `device` (prompt id tensors stay where they are: they are small)."""
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return RolloutBatch(
            prompt_ids=self.prompt_ids, prompt_index=self.prompt_index, response_ids=move(self.response_ids),
            response_mask=move(self.response_mask), loss_mask=move(self.loss_mask), rollout_logp=move(self.rollout_logp),
            finish_reason=self.finish_reason, weight_version=self.weight_version, rollout_topk_ids=move(self.rollout_topk_ids),
            rollout_topk_logp=move(self.rollout_topk_logp), rollout_topk_valid=move(self.rollout_topk_valid),
            **{tag: move(getattr(self, tag)) for tag in self.TAGS},
        )

    @property
    def stale_tokens(self) -> Tensor | None:
        """Staleness per token where the engine stamps each token's version ([B, T]), else per response ([B])."""
        return self.token_staleness if self.token_staleness is not None else self.staleness

    @property
    def response_lengths(self) -> Tensor:
        """[B] int64."""
        return self.response_mask.sum(-1)


def collate(rollouts: Sequence[Rollout], *, pad_id: int = 0) -> RolloutBatch:
    """Right-pad a list of rollouts into a RolloutBatch. Top-K fields are kept only if every rollout has them."""
    if not rollouts:
        raise ValueError("rollouts: expected a non-empty list")
    B = len(rollouts)
    T = max(int(r.response_ids.numel()) for r in rollouts)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    logp = torch.zeros((B, T), dtype=torch.float32)
    has_topk = all(r.rollout_topk_ids is not None for r in rollouts)
    if has_topk:
        S = rollouts[0].rollout_topk_ids.shape[-1]
        if any(r.rollout_topk_ids.shape[-1] != S for r in rollouts):
            raise ValueError("rollouts: top-K widths differ between rollouts")
        topk_ids = torch.zeros((B, T, S), dtype=torch.long)
        topk_logp = torch.zeros((B, T, S), dtype=torch.float32)
        topk_valid = torch.zeros((B, T, S), dtype=torch.bool)
    for i, r in enumerate(rollouts):
        n = int(r.response_ids.numel())
        response_ids[i, :n] = r.response_ids
        mask[i, :n] = True
        logp[i, :n] = r.rollout_logp
        if has_topk:
            topk_ids[i, :n] = r.rollout_topk_ids
            topk_logp[i, :n] = r.rollout_topk_logp
            topk_valid[i, :n] = r.rollout_topk_valid
    loss_mask = mask.clone()
    for i, r in enumerate(rollouts):
        if r.loss_mask is not None:
            loss_mask[i, :r.loss_mask.numel()] = r.loss_mask
    turns = versions = None
    if any(r.turn_index is not None for r in rollouts):  # [B, T]: the assistant turn of each token
        turns = torch.full((B, T), -1, dtype=torch.long)
        for i, r in enumerate(rollouts):
            if r.turn_index is not None:
                turns[i, :r.turn_index.numel()] = r.turn_index
    if all(r.token_versions is not None for r in rollouts):  # [B, T]: the weight version of each token
        versions = torch.zeros((B, T), dtype=torch.long)
        for i, r in enumerate(rollouts):
            versions[i, :r.token_versions.numel()] = r.token_versions
    return RolloutBatch(
        prompt_ids=[r.prompt_ids for r in rollouts],
        prompt_index=torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long),
        response_ids=response_ids,
        response_mask=mask,
        loss_mask=loss_mask,
        rollout_logp=logp,
        finish_reason=[r.finish_reason for r in rollouts],
        weight_version=torch.tensor([r.weight_version for r in rollouts], dtype=torch.long),
        rollout_topk_ids=topk_ids if has_topk else None,
        rollout_topk_logp=topk_logp if has_topk else None,
        rollout_topk_valid=topk_valid if has_topk else None,
        episode=row_episodes(rollouts),  # each row's episode (an agent's episode may be several rows)
        engine=torch.tensor([r.engine for r in rollouts], dtype=torch.long),  # its fleet member
        turn_index=turns,
        token_version=versions,
    )


def stamp_staleness(batch: RolloutBatch, step: int) -> RolloutBatch:
    """`batch` with the staleness of what version `step` trains on: `staleness` [B] per response (the
    optimiser steps since its weights), and `token_staleness` [B, T] per token where the engine stamps each
    token's version (an episode's later turns, an in-flight update, may be fresher)."""
    batch.staleness = (step - batch.weight_version).to(batch.response_ids.device)
    if batch.token_version is not None:
        batch.token_staleness = step - batch.token_version
    return batch


def minibatches(groups: Tensor, mini_batches: int, *, seed: int, step: int, epoch: int,
                device: torch.device, strata: Tensor | None = None) -> list[Tensor]:
    """Split the B sequences into `mini_batches` mini-batches of whole groups (`groups` [B]: each sequence's group,
    non-decreasing: `episode_groups`), the group order shuffled per epoch and step (seeded; epoch 0 of a single
    mini-batch keeps the order). With G rows per group (single rows) the order is that of G contiguous rows.
    `strata` ([n_groups], `group_strata`): the shuffled groups are dealt out by stratum in turn, so that every
    mini-batch with room for them holds a group of each stratum (the first mini-batch, where the step's mismatch is
    measured before any update, sees every fleet member of the step)."""
    groups = groups.cpu()
    M, n_groups = mini_batches, int(groups[-1]) + 1
    gen = torch.Generator().manual_seed(seed * 7919 + step * 31 + epoch)
    order = torch.randperm(n_groups, generator=gen) if epoch > 0 or M > 1 else torch.arange(n_groups)
    if strata is not None and M > 1:
        keys, count, rank = strata.cpu()[order].tolist(), {}, []
        for k in keys:  # rank: the shuffled group is the rank-th of its stratum
            rank.append(count.get(k, 0))
            count[k] = rank[-1] + 1
        order = order[sorted(range(n_groups), key=lambda i: (rank[i], keys[i]))]
    sizes = torch.bincount(groups, minlength=n_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    return [torch.cat([torch.arange(int(starts[g]), int(starts[g] + sizes[g])) for g in chunk.tolist()]).to(device)
            for chunk in order.chunk(M)]


def group_strata(batch: RolloutBatch, groups: Tensor) -> Tensor | None:
    """[n_groups] on the CPU: each group's fleet member (`engine` of its first row), the strata of
    `minibatches`; None without a fleet, or with one member in the batch."""
    if batch.engine is None:
        return None
    sizes = torch.bincount(groups)
    member = batch.engine.cpu()[torch.cumsum(sizes, 0) - sizes].long()
    return member if member.unique().numel() > 1 else None


def episode_groups(batch: RolloutBatch, group_size: int) -> Tensor:
    """[B] int64 on the CPU: each row's group (its episode // G; `episode`, set by `collate`; a batch
    without it has one row per episode)."""
    episode = batch.episode
    return (torch.arange(batch.response_ids.shape[0]) if episode is None else episode.cpu()) // group_size


def loss_inputs(batch: RolloutBatch, micro: Tensor, scores, old, *, topk_divergence, n_turns: int,
                batch_stats: dict[str, Tensor] | None) -> TokenInputs:
    """The per-token inputs of the loss of the micro-batch `micro` (`dppo.losses.TokenInputs`): the Top-K
    divergence of π's cells (`scores`) against the anchor's (`topk_divergence`: topk_tv/topk_kl, None for the
    regions without one), π_old's log-probs (`old`: the recompute anchor's scores, else None), each token's
    staleness (per token where the engine stamps it) and turn, and the mini-batch's statistics."""
    divergence = None
    if topk_divergence is not None:  # Top-K regions: the divergence against the anchor's top-K cells
        anchor_cells = old.topk_logp[micro] if old is not None else batch.rollout_topk_logp[micro]
        divergence = topk_divergence(scores.topk_logp, anchor_cells, batch.rollout_topk_valid[micro])
    stale = batch.stale_tokens
    turn = batch.turn_index
    return TokenInputs(divergence=divergence, old_logp=old.logp[micro] if old is not None else None,
                       staleness=stale[micro] if stale is not None else None,
                       turn_index=turn[micro] if turn is not None else None, n_turns=n_turns, batch_stats=batch_stats)
