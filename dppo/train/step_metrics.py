"""A training step's metrics: the per-micro-batch sums of the update (`StepAccumulator`), the step's own values
(rewards, lengths, staleness: `step_metrics`), the loss's per-token diagnostics (`loss_diagnostics`) and the
samples written to samples.jsonl. Every value stays a tensor until the step's one host sync
(`Dist.reduce_metrics`); the names of the loss's means come from `dppo.metrics.NAMES`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from dppo import metrics
from dppo.divergence import binary_tv
from dppo.train.batch import RolloutBatch
from dppo.train.step_ledger import LedgerSums, micro_terms, step_terms


SPLIT = re.compile(r"_(stale|turn|engine)_\d+$")
"""The name of a split's part: a mean over one staleness, one turn of an episode or one fleet member's tokens."""


class StepAccumulator:
    """Sums per-micro-batch stats as tensors; `result` divides once (no host sync until the step ends)."""

    def __init__(self, device: torch.device, max_staleness: int = 0, max_turns: int = 0, engines: int = 0) -> None:
        self.max_staleness = max_staleness  # the mismatch and masked fraction per staleness 0..k
        self.max_turns = max_turns  # ... and per turn 0..max_turns-1 of multi-turn episodes
        self.engines = engines  # ... and per fleet member 0..engines-1 (rollout.engines; one engine: no split)
        self.means = metrics.WeightedMeans()
        self.ratio_max = torch.zeros((), device=device)
        self.grad_norms: list[Tensor] = []
        self.nonfinite_losses = torch.zeros((), device=device)
        self.hist = torch.zeros(len(metrics.MU_BUCKETS) + 1, device=device)
        self.ledger = LedgerSums()  # the trust-region ledger (`dppo.train.step_ledger`)
        self.mismatch_from_old = False  # (`begin`: the mismatch measured from π_old, every row)

    def _add(self, key: str, value: Tensor, weight: Tensor) -> None:
        self.means.add(key, value, weight)

    def _add_groups(self, prefix: str, values: Tensor, mask: Tensor, group_index: Tensor, n_groups: int) -> None:
        """`prefix`_j: the mean of `values` over the tokens of group j (`metrics.per_group_sums`), j < n_groups."""
        total, count = metrics.per_group_sums(values, mask, group_index, n_groups)
        for j in range(count.shape[0]):
            self._add(f"{prefix}_{j}", total[j] / count[j].clamp(min=1), count[j])

    def add_minibatch_loss(self, loss: Tensor) -> None:
        self._add("loss/policy", loss, torch.ones((), device=loss.device))

    def add_loss(self, stats: dict[str, Tensor]) -> None:
        stats = dict(stats)
        self.ledger.add(stats.pop("ledger", {}))
        n = stats["n_tokens"]
        for name, value, weight in metrics.loss_terms(stats):  # the loss's means, under `metrics.NAMES`
            self._add(name, value, weight)
        for key in metrics.SPLIT_KEYS:  # the mismatch split (loss.split_mismatch), per active token
            if key in stats:
                self._add(key, stats[key], n)
        self.ratio_max = torch.maximum(self.ratio_max, stats["ratio_max"].float())
        if "masked_mu_hist" in stats:
            self.hist += stats["masked_mu_hist"]
        for by, name in (("staleness", "stale"), ("turn", "turn"), ("engine", "engine")):
            if f"masked_by_{by}" in stats:
                n = stats[f"n_by_{by}"]
                frac = stats[f"masked_by_{by}"] / n.clamp(min=1)
                for j in range(n.shape[0]):
                    self._add(f"trust_region/masked_frac_{name}_{j}", frac[j], n[j])

    def add_mismatch(self, batch: RolloutBatch, rows: Tensor, logp: Tensor, cells: Tensor | None) -> None:
        """The engine-trainer mismatch on the rows `rows` of the batch, `logp` and `cells` π's log-probs and top-K
        cells of those rows before any update of the step (the first mini-batch's forward, or π_old of the whole
        batch): the means (`mismatch/*`, `metrics.mismatch_stats`) and their splits per staleness, turn of an episode
        and fleet member, over the same tokens (a part holding every token has the unsplit value)."""
        mask, mu, logp = batch.loss_mask[rows], batch.rollout_logp[rows], logp.detach()
        given = _cells(batch, rows, cells)
        stats = metrics.mismatch_stats(logp, mu, mask, **given)
        n = stats.pop("n_tokens")
        for key, value in stats.items():
            self._add(f"mismatch/{key}", value, n)
        if batch.staleness is not None:  # (set by `step`; absent in a batch made by hand)
            self._add_groups("mismatch/binary_tv_stale", binary_tv(logp, mu), mask, batch.staleness[rows],
                             self.max_staleness + 1)
        splits = []  # per turn of an episode (generated tokens only), per fleet member: (name, group index, groups)
        if self.max_turns and batch.turn_index is not None:
            splits.append(("turn", batch.turn_index[rows], self.max_turns))
        if self.engines > 1 and batch.engine is not None:
            splits.append(("engine", batch.engine[rows], self.engines))
        per_token = metrics.token_mismatch(logp, mu, **given) if splits else {}  # (µ's top-K on every token)
        for by, index, groups in splits:
            for name in ("binary_tv", "topk_tv") if given["logp_cells"] is not None else ("binary_tv",):
                self._add_groups(f"mismatch/{name}_{by}", per_token[name], mask, index, groups)

    def begin(self, batch: RolloutBatch, old) -> "StepAccumulator":
        """Before the step's updates: the mean staleness per turn of an episode over the whole batch and, given
        `old` (π_old's scores of every row: loss.split_mismatch, the recompute anchor), the mismatch of every row."""
        self.mismatch_from_old = old is not None
        if self.max_turns and batch.turn_index is not None and batch.token_staleness is not None:
            self._add_groups("rollout/staleness_turn", batch.token_staleness.float(), batch.loss_mask,
                             batch.turn_index, self.max_turns)
        if old is not None:
            self.add_mismatch(batch, torch.arange(old.logp.shape[0], device=old.logp.device), old.logp, old.topk_logp)
        return self

    def add_before_update(self, batch: RolloutBatch, micro: Tensor, scores) -> None:
        """A micro-batch of the step's first mini-batch (π not yet updated): the policy's entropy and, unless `begin`
        measured it from π_old, the mismatch."""
        if scores.entropy is not None:
            self._add("policy/entropy", *metrics.token_mean(scores.entropy, batch.loss_mask[micro]))
        if not self.mismatch_from_old:
            self.add_mismatch(batch, micro, scores.logp, scores.topk_logp)

    def add_grad_norm(self, grad_norm: Tensor, loss_finite: Tensor) -> None:
        self.grad_norms.append(grad_norm.float())
        self.nonfinite_losses = self.nonfinite_losses + (~loss_finite).float()

    def result_means(self) -> dict[str, Tensor]:
        """Every summed value's weighted mean, and each split part's `count/`."""
        out = self.means.means()
        # the token count behind each split's value (per staleness, turn, fleet member): `prune_unreached` drops the
        # values of a part with no tokens in the step (a turn no episode reached, a member with no rows)
        out.update({f"count/{k}": self.means.weight(k) for k in self.means.sums if SPLIT.search(k)})
        return out

    def result(self) -> dict[str, Tensor]:
        out = self.result_means()
        out["ratio/max"] = self.ratio_max
        norms = torch.stack(self.grad_norms)
        out["optim/grad_norm"] = norms.mean()
        out["optim/nonfinite_grad_steps"] = (~torch.isfinite(norms)).float().sum()
        out["optim/nonfinite_loss_steps"] = self.nonfinite_losses
        out.update({f"trust_region/{k}": v for k, v in metrics.masked_mu_shares(self.hist).items()})
        out.update(self.ledger.result())
        return out



def _cells(batch: RolloutBatch, micro: Tensor, cells: Tensor | None) -> dict[str, Tensor | None]:
    """The top-K arguments of `metrics.mismatch_stats` / `token_mismatch`: π's cells `cells` of the micro-batch beside
    µ's recorded ones (all None unless both exist)."""
    both = cells is not None and batch.rollout_topk_logp is not None
    return dict(logp_cells=cells.detach() if both else None,
                rollout_cells=batch.rollout_topk_logp[micro] if both else None,
                cells_valid=batch.rollout_topk_valid[micro] if both else None)


def step_metrics(batch: RolloutBatch, rewards: Tensor, success: Tensor, reward_stats: dict, adv_stats: dict,
                 update: dict, *, lr: float, skipped_steps: int, max_staleness: int, engines: int = 0,
                 adv: Tensor | None = None, group_size: int = 1) -> dict[str, Any]:
    """The step's metrics before the one host sync (`perf/*` timings are added by the trainer). `success`: [B] bool,
    each episode's `dppo.episodes.results.episode_success` (reward/accuracy is its mean, as evaluation's pass@1).
    engines: the run's engines (rollout.engines; with one, nothing is split), whose responses are also reported apart
    (`engine_metrics`)."""
    lengths = batch.response_lengths.float()
    return {
        **(engine_metrics(batch, rewards, success, engines) if engines > 1 else {}),
        **(step_terms(rewards, adv, group_size) if adv is not None else {}),
        "reward/mean": rewards.mean(),
        "reward/std": rewards.std() if rewards.numel() > 1 else rewards.new_zeros(()),
        "reward/accuracy": success.float().mean(),
        "reward/failures": float(reward_stats.get("failures", 0)),
        "reward/timeouts": float(reward_stats.get("timeouts", 0)),
        "response/length_mean": lengths.mean(),
        "response/length_max": lengths.max(),
        "response/truncated_frac": float(sum(r == "length" for r in batch.finish_reason)) / len(batch.finish_reason),
        "advantage/zero_group_frac": adv_stats["zero_adv_group_frac"],
        **staleness_metrics(batch, max_staleness),
        **update,
        "optim/lr": lr,
        "optim/skipped_steps_total": float(skipped_steps),
        "perf/response_tokens": lengths.sum(),
        "perf/prompt_tokens": float(sum(int(p.numel()) for p in batch.prompt_ids)),
    }


def engine_metrics(batch: RolloutBatch, rewards: Tensor, success: Tensor, engines: int) -> dict[str, Tensor]:
    """Per fleet member j < engines (`batch.engine`): its share of the step's responses
    (`rollout/frac_engine_{j}`), their mean reward, accuracy (`rewards`, `success`: [E] per episode, read per row
    through `batch.episode`) and length."""
    onehot = (batch.engine[:, None] == torch.arange(engines, device=rewards.device)).float()  # [B, M]
    count, episode = onehot.sum(0), batch.episode
    per_row = {"reward/mean": rewards[episode].float(), "reward/accuracy": success[episode].float(),
               "response/length_mean": batch.response_lengths.float()}
    out = {f"rollout/frac_engine_{j}": count[j] / onehot.shape[0] for j in range(engines)}
    for name, values in per_row.items():
        means = (values @ onehot) / count.clamp(min=1)
        out.update({f"{name}_engine_{j}": means[j] for j in range(engines)})
    return out


def staleness_metrics(batch: RolloutBatch, max_staleness: int) -> dict[str, Any]:
    """How many optimiser steps behind the trainer each trained response's weights were, from the versions the
    source recorded: mean, max, and the share per value 0..max_staleness (the source's bound)."""
    st = batch.staleness.float()
    out = {"rollout/staleness_mean": st.mean(), "rollout/staleness_max": st.max()}
    for j in range(max_staleness + 1):
        out[f"rollout/staleness_frac_{j}"] = (st == j).float().mean()
    return out


def prune_unreached(values: dict[str, float], max_staleness: int) -> dict[str, float]:
    """The synced metrics without the values of a split's part with no tokens in the step (their `count/` is 0: a
    turn no episode reached, a fleet member with no rows) and the per-staleness values of a staleness not trained:
    they are computed as tensors (knowing which are empty would need a host sync of its own) and dropped here,
    after the step's one sync."""
    out = dict(values)
    for key in [k for k in out if k.startswith("count/")]:
        if out.pop(key) == 0.0:
            out.pop(key[len("count/"):], None)
    for j in range(max_staleness + 1):
        if out[f"rollout/staleness_frac_{j}"] == 0.0:
            out.pop(f"mismatch/binary_tv_stale_{j}", None)
            out.pop(f"trust_region/masked_frac_stale_{j}", None)
    for share in [k for k in out if k.startswith("rollout/frac_engine_") and out[k] == 0.0]:  # a member left out
        suffix = share[len("rollout/frac"):]  # "_engine_{j}"
        for key in [k for k in out if k.endswith(suffix) and k != share]:
            out.pop(key)
    return out


def loss_diagnostics(stats: dict[str, Tensor], batch: RolloutBatch, micro: Tensor, logp: Tensor,
                     old_logp: Tensor | None, *, max_staleness: int, max_turns: int, engines: int = 0,
                     adv: Tensor | None = None) -> dict[str, Tensor]:
    """A loss's stats with its trust-region mask `keep` turned into what `StepAccumulator.add_loss` sums: the
    masked share by µ bucket, per staleness, per turn of an episode and per engine (`engines` > 1), with
    `old_logp` (π_old's log-probs of the micro-batch: loss.split_mismatch or the recompute anchor) the masked share
    split into mismatch and update, and with `adv` (the micro-batch's advantages) the trust-region ledger's terms
    (`dppo.train.step_ledger`, under "ledger")."""
    stats = dict(stats)
    if "keep" not in stats:
        return stats
    mask, rollout_logp = batch.loss_mask[micro], batch.rollout_logp[micro]  # generated tokens only
    keep = stats.pop("keep")
    stats["masked_mu_hist"] = metrics.masked_mu_histogram(keep, rollout_logp, mask)
    if batch.staleness is not None:  # masked tokens per staleness
        stats["masked_by_staleness"], stats["n_by_staleness"] = metrics.per_group_sums(
            ~keep, mask, batch.staleness[micro], max_staleness + 1)
    if batch.turn_index is not None:  # masked tokens per turn of an episode
        stats["masked_by_turn"], stats["n_by_turn"] = metrics.per_group_sums(
            ~keep, mask, batch.turn_index[micro], max_turns)
    if engines > 1 and batch.engine is not None:  # masked tokens per engine
        stats["masked_by_engine"], stats["n_by_engine"] = metrics.per_group_sums(
            ~keep, mask, batch.engine[micro], engines)
    if old_logp is not None:
        split = metrics.mismatch_split(logp.detach(), old_logp, rollout_logp, mask, keep)
        split.pop("n_tokens")  # (the loss's own count)
        stats.update(split)
    if adv is not None:
        stale = batch.stale_tokens
        reward = batch.reward
        stats["ledger"] = micro_terms(keep, logp, rollout_logp, adv, mask, old_logp=old_logp,
                                      staleness=None if stale is None else stale[micro],
                                      rewards=None if reward is None else reward[micro])
    return stats


def samples(completions: list[str], rewards: Tensor, batch: RolloutBatch, examples: list, n: int) -> list[dict[str, Any]]:
    """The first `n` rows of the step as samples.jsonl rows (prompt, completion, answer, and the reward of its
    episode: `rewards` come per episode; for a multi-turn episode also its `episode` record, `_episode_record`)."""
    n = min(n, len(completions))
    idx = batch.prompt_index.tolist()
    rewards = rewards[batch.episode.to(rewards.device)] if batch.episode is not None else rewards  # per row
    rows = [{"prompt": _prompt_text(examples[idx[i]].prompt), "completion": completions[i],
             "answer": examples[idx[i]].answer, "reward": float(rewards[i])} for i in range(n)]
    if batch.turn_index is not None:
        for i, row in enumerate(rows):
            row["episode"] = _episode_record(batch, i)
    return rows


def _episode_record(batch: RolloutBatch, i: int) -> dict[str, Any]:
    """Per turn of episode `i`: its generated tokens and, when the engine recorded µ's top-K, how many of them carry
    µ's cells (equal to the generated tokens: µ's top-K is recorded on every generated token of every turn)."""
    generated = batch.loss_mask[i].bool()
    turn = batch.turn_index[i][generated].cpu()
    turns = int(turn.max()) + 1 if turn.numel() else 0
    record: dict[str, Any] = {"turns": turns, "generated_tokens_per_turn": torch.bincount(turn, minlength=turns).tolist()}
    if batch.rollout_topk_valid is not None:
        with_cells = batch.rollout_topk_valid[i].any(-1)[generated].cpu()
        record["topk_cells_per_turn"] = torch.bincount(turn[with_cells], minlength=turns).tolist()
    return record


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
