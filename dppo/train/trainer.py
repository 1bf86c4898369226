"""The DPPO training loop (spec §7): rollout → reward → advantage → E×M updates → publish weights → log.

`Trainer.step` reads top to bottom, the same in every sampling mode: the batch comes from a `RolloutSource`
(`dppo.rollout.source`: an engine in this process, the same engine rollout.engine_lag versions behind, or rollout
workers that sample ahead, up to rollout.max_staleness versions behind), and the new weights are published to it
as the next version. Each response records the version that sampled it, so its staleness is measured. The
importance weight of every update is π/µ against the engine's recorded log-probs; the trust-region mask is
anchored at µ (or at the recomputed π_old when `loss.anchor = "recompute"`, which costs one extra no-grad
forward). Mini-batches after the first are off-policy by construction — what the trust region is for. All
metrics stay tensors until the end of an optimiser step (one host sync per optimiser step, for the
finite-gradient check) and of a training step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dppo.advantages import compute_advantages
from dppo.run_files.checkpoint import load_latest, load_optimizer, save_training_checkpoint, set_rng_state
from dppo.train.config import Config
from dppo import metrics
from dppo.divergence import binary_tv, topk_kl, topk_tv
from dppo.runtime.faults import fault_point
from dppo.run_files.logger import RunLogger
from dppo.rewards.runner import NonFiniteRewardError
from dppo.losses import LOSSES, TokenInputs, aggregation_denominator, batch_stat_values, batch_statistics
from dppo.rollout.base import SamplingParams
from dppo.train.batch import RolloutBatch, collate
from dppo.rollout.source import Draw
from dppo.rollout.episodes import episode_rewards
from dppo.train.build import (announce_rollout, build_episodes, build_model, build_scorer, build_source, build_task,
                              check_environment, check_rollout, resolve_config, resolve_device)
from dppo.train.evaluation import evaluate, load_checkpoint_weights
from dppo.train.scoring import Scores
from dppo.train.distributed import init_from_env, local_tensor
from dppo.train.weights import engine_state

SKIP_WARN_EVERY = 10  # a skipped optimiser step is announced when a streak starts and then every 10th skip


class PromptSampler:
    """Seeded epoch-wise permutation over the training examples; its position is part of a checkpoint."""

    def __init__(self, n: int, seed: int, position: int = 0) -> None:
        self.n, self.seed, self.position = n, seed, position

    def next(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            epoch, offset = divmod(self.position, self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            take = min(count - len(out), self.n - offset)
            out.extend(perm[offset:offset + take].tolist())
            self.position += take
        return out


@dataclass
class StepTimer:
    """Wall-clock seconds per phase of one step. On CUDA each phase boundary synchronises the device (a handful of
    syncs per micro-batch), so the kernels are charged to the phase that launched them. `training` contains
    `forward`, `loss`, `backward` and `optimizer` (and the Python between them)."""

    cuda: bool = False
    generation: float = 0.0
    reward: float = 0.0
    recompute: float = 0.0
    training: float = 0.0
    forward: float = 0.0
    loss: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    sync: float = 0.0
    metrics: float = 0.0

    @contextlib.contextmanager
    def time(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    def as_metrics(self) -> dict[str, float]:
        return {f"perf/{k}_s": v for k, v in vars(self).items() if k != "cuda"}


class GracefulStop:
    """While active, the first SIGINT/SIGTERM only records `signum`: the loop finishes its step, checkpoints and
    returns. The handlers that were there before come back at once, so a second signal acts as usual (Ctrl-C
    raises KeyboardInterrupt, SIGTERM terminates; a half-written checkpoint is never loaded). Off the main
    thread, where Python cannot install handlers, it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                self._previous[sig] = signal.SIG_DFL if previous is None else previous
        return self

    def _handle(self, signum: int, frame) -> None:
        self.signum = signum
        self._restore()
        os.write(2, f"\n[dppo] {signal.Signals(signum).name}: stopping after the current step "
                    f"(send it again to stop now)\n".encode())

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc) -> None:
        self._restore()


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False) -> None:
        """`self.cfg` is `cfg` resolved (`dppo.train.build.resolve_config`: engine, dtype, K and the trust region's
        parameters as this run uses them), which `dppo train` saves as the run directory's config.yaml."""
        self.cfg, self.run_dir = resolve_config(cfg), Path(run_dir)
        requested, cfg = cfg, self.cfg
        self.dist = init_from_env(cfg, resolve_device(cfg.model.device))  # under torchrun: join the process group
        self._closed = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        _seed_everything(cfg.train.seed)
        check_rollout(cfg, resolve_device(cfg.model.device))  # before any model loads
        self.task = build_task(cfg)  # validates data before any model is loaded
        self.train_examples, self.eval_examples = list(self.task.train), list(self.task.eval)
        env_line = check_environment(cfg, self.train_examples)  # env settings fail here, before any model loads
        self.episodes = build_episodes(cfg, self.task)  # every response is an episode of the run's environment
        self.max_response_len = self.episodes.max_tokens
        self.model, self.tokenizer, self.model_path = build_model(cfg, self.run_dir)
        self.scorer = build_scorer(cfg, self.model, self.dist)  # DDP/FSDP2 under torchrun (FSDP2 shards self.model)
        self.loss_spec = cfg.loss.spec()  # resolved and checked once (dppo.loss_spec)
        self.loss_fn = LOSSES[self.loss_spec.loss]
        region = self.loss_spec.region
        self.topk_divergence = {"topk_tv": topk_tv, "topk_kl": topk_kl}[region.divergence] if region.needs_topk else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = next(self.model.parameters()).device
        self.optimizer = make_optimizer(self.params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                        weight_decay=cfg.optim.weight_decay)
        warm = cfg.optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.step_idx = 0
        self.sampler = PromptSampler(len(self.train_examples), cfg.train.seed)
        self.skipped_steps = 0
        self.consecutive_skips = 0  # optimiser steps skipped in a row; train.max_consecutive_skips stops the run
        self._first_skip: tuple[int, str] | None = None  # (step, non-finite tensor) that began the current streak
        self._log_write_s = 0.0  # seconds the logger took to write the previous step's metrics
        if resume:
            self._restore()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stop_ids = tuple(sorted({i for i in [self.tokenizer.eos_token_id] if i is not None}))
        self.logger = RunLogger.for_run(self.run_dir, cfg, start_step=self.step_idx, active=self.dist.is_main)
        announce = lambda line: print(line, flush=True) if self.dist.is_main else None  # noqa: E731
        announce_rollout(requested, announce)  # what `auto` chose and why (the resolved config only says what)
        if env_line:
            announce(env_line)
        # the engine (or the rollout workers) holding the current weights as version step_idx; with
        # rollout.engine_lag a resumed run's lag restarts from the resumed weights
        self.source = build_source(cfg, self.episodes, draw=self._draw, weights=self._engine_state(),
                                   version=self.step_idx, position=self.sampler.position, device=self.device,
                                   rank=self.dist.rank, announce=announce)

    @property
    def engine(self):
        """The in-process rollout engine (None when the rollout workers sample: rollout.mode async)."""
        return self.source.engine

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run up to train.steps. SIGINT/SIGTERM finish the current step, checkpoint it and return early with
        `stopped_early: True` (a second signal gets the previous handler: Ctrl-C raises, SIGTERM terminates)."""
        cfg = self.cfg
        results: dict[str, Any] = {"stopped_early": False}
        with GracefulStop() as stop:
            if cfg.train.eval_before and self.step_idx == 0 and self.eval_examples:
                results["eval_before"] = self.evaluate_and_log()
            while self.step_idx < cfg.train.steps:
                metrics = self.step()
                t_log, failure = time.perf_counter(), None
                try:  # only rank 0 writes: under torchrun every rank learns of its failure (a full disk) here
                    self.logger.log_step(self.step_idx, metrics)
                except Exception as exc:  # noqa: BLE001 - raised on every rank just below
                    failure = exc
                self.dist.agree(failure)
                self._log_write_s = time.perf_counter() - t_log  # reported with the next step
                stopping = self.dist.any_true(stop.signum is not None)  # every rank stops after the same step
                if not stopping and cfg.train.eval_every and self.step_idx % cfg.train.eval_every == 0 \
                        and self.step_idx < cfg.train.steps:
                    self.evaluate_and_log()
                saved = None
                if cfg.train.checkpoint_every and self.step_idx % cfg.train.checkpoint_every == 0:
                    saved = self.save()
                if stopping:
                    path = saved or self.save()
                    name = signal.Signals(stop.signum or signal.SIGTERM).name  # (another rank's signal: its name)
                    self.logger.print(f"[dppo] {name}: stopped after step {self.step_idx}, checkpoint {path}")
                    self.logger.close()
                    return {**results, "stopped_early": True, "signal": name,
                            "step": self.step_idx, "checkpoint": str(path)}
            if self.eval_examples:
                results["eval_after"] = self.evaluate_and_log()
            results["step"] = self.step_idx
            results["checkpoint"] = str(self.save())
        self.logger.close()
        return results

    def step(self) -> dict[str, float]:
        cfg, timer = self.cfg, StepTimer(cuda=self.device.type == "cuda")
        t_start = time.perf_counter()
        failure = None
        try:
            with timer.time("generation"):
                examples, rollouts = self.source.take(self.step_idx)  # episodes, scored by their environment
                fault_point("rollout", self.step_idx + 1)
                cpu_batch = collate(rollouts, pad_id=self.pad_id)
                batch = cpu_batch.to(self.device)  # staleness of each response: trained by version step_idx
                batch.extras["staleness"] = (self.step_idx - batch.weight_version).to(self.device)
                if "token_version" in batch.extras:  # per token (an episode's later turns may be fresher)
                    batch.extras["token_staleness"] = self.step_idx - batch.extras["token_version"]
            with timer.time("reward"):
                rewards, reward_stats = episode_rewards(rollouts)
                rewards = rewards.to(self.device)
                completions = [r.episode.completion for r in rollouts]
        except Exception as exc:  # noqa: BLE001 - agreed below: raised on every rank (one process: re-raised)
            failure = exc
        skip = self.dist.agree(failure, skip=NonFiniteRewardError)
        if skip is not None:  # a broken reward (on any rank): no update from this batch
            return self._skip_step(skip, t_start)
        with timer.time("reward"):  # after the agreement: under torchrun a collective (the global batch's rewards)
            adv, adv_stats = self._advantages(rewards)
        with timer.time("recompute"):
            old = self._recompute(batch) if cfg.loss.anchor == "recompute" or cfg.loss.split_mismatch else None
        with timer.time("training"):
            update_stats = self._update(batch, adv, old, timer)
        with timer.time("sync"):
            self._publish_weights()
        self.step_idx += 1
        source_stats = self.source.metrics()
        with timer.time("metrics"):
            self.logger.log_samples(self.step_idx, self._samples(completions, rewards, batch, examples))
            metrics = self._step_metrics(batch, rewards, reward_stats, adv_stats, update_stats)
            for key in [k for k in metrics if k.startswith("count/")]:  # per-turn values of turns not reached
                if metrics.pop(key) == 0.0:
                    metrics.pop(key[len("count/"):], None)
            metrics.update(self.episodes.metrics(rollouts))  # (episode/*: multi-turn environments only)
            for j in range(self.source.max_staleness + 1):
                if metrics[f"rollout/staleness_frac_{j}"] == 0.0:  # per-staleness values of a staleness not trained
                    metrics.pop(f"mismatch/binary_tv_stale_{j}", None)
                    metrics.pop(f"trust_region/masked_frac_stale_{j}", None)
        step_s = time.perf_counter() - t_start
        tokens = metrics["perf/response_tokens"] + metrics["perf/prompt_tokens"]  # (all ranks)
        return {**metrics, **source_stats, **timer.as_metrics(), "perf/step_s": step_s,
                "perf/tokens_per_s": tokens / max(step_s, 1e-9), "perf/log_write_prev_s": self._log_write_s}

    def _draw(self, step: int) -> Draw:
        """The prompts of training step `step` (the source calls it when it samples that step's batch). Every rank
        draws the same prompts and keeps its contiguous share (whole groups stay on one rank)."""
        examples = [self.train_examples[i] for i in self.dist.shard(self.sampler.next(self.cfg.rollout.prompts_per_step))]
        return Draw(examples, self._sampling_params(step), self.sampler.position)

    # ------------------------------------------------------------------ pieces of a step
    def _sampling_params(self, step: int, *, n: int | None = None, temperature: float | None = None,
                         top_k_logprobs: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.group_size if n is None else n,
            temperature=r.temperature if temperature is None else temperature,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=self.stop_ids,
            top_k_logprobs=self.cfg.top_k_logprobs if top_k_logprobs is None else top_k_logprobs,
            seed=self.cfg.train.seed * 100_003 + step + (self.dist.rank << 32),  # ranks sample differently
        )

    def _score(self, batch: RolloutBatch, idx: Tensor, *, grad: bool, with_entropy: bool = False):
        """π's log-probs (and top-K cells, entropy) for the sequences `idx` of the batch."""
        cfg = self.cfg
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.model.autocast_bf16 \
            else contextlib.nullcontext()
        with (contextlib.nullcontext() if grad else torch.no_grad()), autocast:
            return self.scorer(
                [batch.prompt_ids[i] for i in idx.tolist()], batch.response_ids[idx], batch.response_mask[idx],
                temperature=cfg.rollout.temperature,
                topk_ids=batch.rollout_topk_ids[idx] if batch.rollout_topk_ids is not None else None,
                with_entropy=with_entropy, pad_id=self.pad_id,
            )

    def _publish_weights(self) -> None:
        """After a training step: its weights become version step_idx + 1 of the source (versions count steps)."""
        self.source.publish(self.step_idx + 1, self._engine_state())

    def _engine_state(self) -> dict[str, Tensor]:
        """The weights an engine loads, as a state dict (LoRA merged; under FSDP2 a collective)."""
        return engine_state(self.model, self.dist)

    def _recompute(self, batch: RolloutBatch) -> Scores:
        """π_old's scores of the whole batch before any update (the recompute anchor), one micro-batch at a time."""
        idx = torch.arange(batch.response_ids.shape[0], device=self.device)
        parts = [self._score(batch, micro, grad=False) for micro in idx.split(self.cfg.train.micro_batch_size)]
        return Scores(*(None if part[0] is None else torch.cat(part) for part in zip(*parts)))

    def _advantages(self, rewards: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Advantages of this rank's rewards, computed over the global batch (under torchrun every rank gathers
        all ranks' rewards, so batch-level statistics such as group_mean_batch_std's std are the global ones)."""
        a = self.cfg.advantage
        every = self.dist.all_gather_rows(rewards)
        adv, stats = compute_advantages(a.estimator, every, self.cfg.rollout.group_size, eps=a.eps)
        n = rewards.shape[0]
        return adv[self.dist.rank * n:(self.dist.rank + 1) * n], stats

    def _minibatches(self, B: int, epoch: int) -> list[Tensor]:
        """Split the B = P·G sequences into mini-batches of whole groups, group order shuffled per epoch."""
        G, M = self.cfg.rollout.group_size, self.cfg.train.mini_batches
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 7919 + self.step_idx * 31 + epoch)
        groups = torch.randperm(B // G, generator=gen) if epoch > 0 or M > 1 else torch.arange(B // G)
        seqs = (groups[:, None] * G + torch.arange(G)[None, :]).reshape(-1).to(self.device)
        return list(seqs.chunk(M))

    def _update(self, batch: RolloutBatch, adv: Tensor, old, timer: StepTimer | None = None) -> dict[str, Any]:
        cfg = self.cfg
        timer = timer or StepTimer(cuda=self.device.type == "cuda")
        acc = _Accumulator(self.device, self.source.max_staleness, self.episodes.max_turns)
        first = True
        for epoch in range(cfg.train.epochs):
            for mb in self._minibatches(batch.response_ids.shape[0], epoch):
                denom = self.dist.global_denominator(aggregation_denominator(batch.loss_mask[mb], cfg.loss.aggregation))
                batch_stats = self._batch_stats(batch, mb, old)  # {} unless the trust region reads one
                loss_finite = torch.ones((), dtype=torch.bool, device=self.device)
                mb_loss = torch.zeros((), device=self.device)  # the mini-batch's loss: the sum of its micro-batches'
                micros = mb.split(cfg.train.micro_batch_size)
                for micro in micros:
                    self.dist.grad_sync(self.scorer, micro is micros[-1])  # DDP/FSDP2: reduce once per mini-batch
                    with timer.time("forward"):
                        scores = self._score(batch, micro, grad=True, with_entropy=first)
                    with timer.time("loss"):
                        loss, stats = self._loss(batch, micro, scores, adv, old, denom, batch_stats)
                    with timer.time("backward"):
                        loss.backward()  # a non-finite loss still backpropagates; _optimizer_step then skips the step
                    with timer.time("loss"):
                        loss_finite &= torch.isfinite(loss.detach())
                        mb_loss = mb_loss + loss.detach().float()
                        acc.add_loss(stats)
                        if first:  # the mismatch between engine and trainer before any update of this step
                            acc.add_mismatch(batch, micro, scores)
                with timer.time("optimizer"):
                    grad_norm = self._optimizer_step(loss_finite)
                fault_point("update", self.step_idx + 1)
                acc.add_grad_norm(grad_norm, loss_finite)
                acc.add_minibatch_loss(mb_loss)
                first = False
        return acc.result()

    def _batch_stats(self, batch: RolloutBatch, mb: Tensor, old) -> dict[str, Tensor] | None:
        """The statistics of the whole mini-batch `mb` that the trust region reads (`TrustRegion.batch_stats`, e.g.
        SAT's tail quantile), over its active tokens on every rank; None when the region reads none. Costs one
        no-grad forward of the mini-batch, micro-batch by micro-batch (the weights do not change inside a mini-batch,
        so π here is the π of every micro-batch's loss)."""
        spec = self.loss_spec
        if not spec.region.batch_stats:
            return None
        parts: dict[str, list[Tensor]] = {name: [] for name in spec.region.batch_stats}
        for micro in mb.split(self.cfg.train.micro_batch_size):
            logp = self._score(batch, micro, grad=False).logp
            anchor = old.logp[micro] if spec.anchor == "recompute" else batch.rollout_logp[micro]
            for name, v in batch_stat_values(spec, logp, anchor, batch.loss_mask[micro]).items():
                parts[name].append(v.reshape(-1))
        values = {name: torch.cat(v) for name, v in parts.items()}
        if self.dist.enabled:  # every rank's values, padded to the longest rank's (NaN = no token)
            lengths = self.dist.all_gather_rows(torch.tensor([mb.shape[0] * batch.response_ids.shape[1]],
                                                             device=self.device))
            width = int(lengths.max())
            values = {name: self.dist.all_gather_rows(
                torch.nn.functional.pad(v, (0, width - v.shape[0]), value=float("nan"))[None]).reshape(-1)
                for name, v in values.items()}
        return batch_statistics(spec, values)

    def _loss(self, batch, micro, scores, adv, old, denom, batch_stats=None):
        """The loss of one micro-batch (a `dppo.losses.LOSSES` entry) and its metrics. `old` (π_old's scores) is the
        recompute anchor, or with anchor rollout only the reference of the mismatch split (loss.split_mismatch);
        `batch_stats`: the mini-batch's statistics the trust region reads (`_batch_stats`)."""
        mask, rollout_logp = batch.loss_mask[micro], batch.rollout_logp[micro]  # generated tokens only
        anchor_old = old if self.cfg.loss.anchor == "recompute" else None
        divergence = None
        if self.topk_divergence is not None:  # Top-K regions: the divergence against the anchor's top-K cells
            anchor_cells = anchor_old.topk_logp[micro] if anchor_old is not None else batch.rollout_topk_logp[micro]
            divergence = self.topk_divergence(scores.topk_logp, anchor_cells, batch.rollout_topk_valid[micro])
        stale = batch.extras.get("token_staleness", batch.extras.get("staleness"))
        turn = batch.extras.get("turn_index")
        inputs = TokenInputs(divergence=divergence, old_logp=anchor_old.logp[micro] if anchor_old is not None else None,
                             staleness=stale[micro] if stale is not None else None,
                             turn_index=turn[micro] if turn is not None else None,
                             n_turns=max(self.cfg.env.max_turns, 1), batch_stats=batch_stats)
        loss, stats = self.loss_fn(scores.logp, rollout_logp, adv[micro], mask, self.loss_spec, inputs,
                                   max_response_len=self.max_response_len, denominator=denom)
        stats = dict(stats)
        if "keep" in stats:
            keep = stats.pop("keep")
            stats["masked_mu_hist"] = metrics.masked_mu_histogram(keep, rollout_logp, mask)
            if "staleness" in batch.extras:  # masked tokens per staleness
                stats["masked_by_staleness"], stats["n_by_staleness"] = metrics.per_group_sums(
                    ~keep, mask, batch.extras["staleness"][micro], self.source.max_staleness + 1)
            if "turn_index" in batch.extras:  # masked tokens per turn of an episode
                stats["masked_by_turn"], stats["n_by_turn"] = metrics.per_group_sums(
                    ~keep, mask, batch.extras["turn_index"][micro], self.cfg.env.max_turns)
            if old is not None and self.cfg.loss.split_mismatch:
                split = metrics.mismatch_split(scores.logp.detach(), old.logp[micro], rollout_logp, mask, keep)
                split.pop("n_tokens")  # (the loss's own count)
                stats.update(split)
        return loss, stats

    def _optimizer_step(self, loss_finite: Tensor) -> Tensor:
        """Clip and step only if the mini-batch's loss and gradient norm are finite; otherwise skip (weights and
        optimiser state untouched), count it, and raise after train.max_consecutive_skips skips in a row."""
        clip = self.cfg.optim.grad_clip
        grad_norm = self.dist.grad_norm(self.params)  # global: the same on every rank
        if bool(self.dist.all_true(torch.isfinite(grad_norm) & loss_finite)):  # the one host sync per optimiser step
            if clip > 0:
                self.dist.clip_(self.params, clip, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.consecutive_skips, self._first_skip = 0, None
        else:
            self._skip(bool(loss_finite))  # before zero_grad: it names the first non-finite gradient
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def _skip_step(self, reason: str, t_start: float) -> dict[str, float]:
        """A step whose rewards were non-finite: no update, counted like a skipped optimiser step."""
        self._skip(True, culprit=f"reward ({reason})")
        self._publish_weights()  # the unchanged weights become the next version (versions count steps)
        self.step_idx += 1
        return {"reward/nonfinite_steps": 1.0, "optim/skipped_steps_total": float(self.skipped_steps),
                "perf/step_s": time.perf_counter() - t_start}

    def _skip(self, loss_finite: bool, culprit: str | None = None) -> None:
        """Count a skipped optimiser step; too many in a row raise RuntimeError naming the non-finite tensor."""
        if culprit is None:
            culprit = "loss" if not loss_finite else next(
                (f"gradient of {n}" for n, p in self.model.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())), "gradient norm")
        step = self.step_idx + 1  # the training step being computed (step_idx counts completed ones)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self._first_skip = self._first_skip or (step, culprit)
        limit = self.cfg.train.max_consecutive_skips
        if self.consecutive_skips == 1 or self.skipped_steps % SKIP_WARN_EVERY == 0:  # not one line per skip
            self.logger.print(f"[dppo] step {step}: optimiser step skipped, non-finite {culprit} "
                              f"({self.consecutive_skips} in a row, limit {limit}; {self.skipped_steps} in total)")
        if self.consecutive_skips >= limit:
            first_step, first = self._first_skip
            raise RuntimeError(f"step {step}: {self.consecutive_skips} consecutive optimiser steps skipped for non-finite "
                               f"values (train.max_consecutive_skips = {limit}); first non-finite tensor: {first} "
                               f"(at step {first_step}); latest: {culprit}")

    # ------------------------------------------------------------------ metrics
    def _step_metrics(self, batch, rewards, reward_stats, adv_stats, update) -> dict[str, float]:
        """The step's metrics as floats (perf/* added by `step`): one host sync."""
        lengths = batch.response_lengths.float()
        out = {
            "reward/mean": rewards.mean(),
            "reward/std": rewards.std() if rewards.numel() > 1 else rewards.new_zeros(()),
            "reward/accuracy": (rewards >= 1.0 - 1e-6).float().mean(),
            "reward/failures": float(reward_stats.get("failures", 0)),
            "reward/timeouts": float(reward_stats.get("timeouts", 0)),
            "response/length_mean": lengths.mean(),
            "response/length_max": lengths.max(),
            "response/truncated_frac": float(sum(r == "length" for r in batch.finish_reason)) / len(batch.finish_reason),
            "advantage/zero_group_frac": adv_stats["zero_adv_group_frac"],
            **self._staleness_metrics(batch),
            **update,
            "optim/lr": self.scheduler.get_last_lr()[0],
            "optim/skipped_steps_total": float(self.skipped_steps),
            "perf/response_tokens": lengths.sum(),
            "perf/prompt_tokens": float(sum(int(p.numel()) for p in batch.prompt_ids)),
        }
        return self.dist.reduce_metrics(out)  # the one sync of the step (over ranks: one all-gather)

    def _staleness_metrics(self, batch: RolloutBatch) -> dict[str, Any]:
        """How many optimiser steps behind the trainer each trained response's weights were, from the versions the
        source recorded: mean, max, and the share per value 0..the source's bound."""
        st = batch.extras["staleness"].float()
        out = {"rollout/staleness_mean": st.mean(), "rollout/staleness_max": st.max()}
        for j in range(self.source.max_staleness + 1):
            out[f"rollout/staleness_frac_{j}"] = (st == j).float().mean()
        return out

    def _samples(self, completions, rewards, batch, examples) -> list[dict[str, Any]]:
        n = min(self.cfg.log.samples_per_step, len(completions))
        idx = batch.prompt_index.tolist()
        return [{"prompt": _prompt_text(examples[idx[i]].prompt), "completion": completions[i],
                 "answer": examples[idx[i]].answer, "reward": float(rewards[i])} for i in range(n)]

    # ------------------------------------------------------------------ eval and checkpoints
    def evaluate(self, examples=None, *, temperature: float | None = None) -> dict[str, float]:
        """Sampled pass@1 and mean reward on held-out examples (one response each)."""
        examples = self.eval_examples if examples is None else examples
        temp = temperature or self.cfg.train.eval_temperature or self.cfg.rollout.temperature
        params = self._sampling_params(10_000_000 + self.step_idx, n=self.cfg.train.eval_samples_per_prompt,
                                       temperature=temp, top_k_logprobs=0)
        return self.dist.evaluate(  # each rank evaluates its share of the examples
            lambda share: evaluate(self.source, share, params, pad_id=self.pad_id), examples)

    def evaluate_and_log(self) -> dict[str, float]:
        result = self.evaluate()
        self.logger.log_eval(self.step_idx, result)
        self.logger.print(f"[dppo] eval @ step {self.step_idx}: pass@1 {result['pass@1']:.3f}, "
                          f"mean reward {result['reward_mean']:.3f} over {result['n']} held-out samples")
        return result

    def save(self) -> Path:
        # the position after the last trained batch, so a resume draws any batches in flight (async) again
        state = {"sampler_position": self.source.trained_position, "skipped_steps": self.skipped_steps}
        return save_training_checkpoint(self.dist, self.run_dir, self.step_idx, model=self.model, optimizer=self.optimizer,
                                         scheduler=self.scheduler, trainer_state=state,
                                         keep=self.cfg.train.keep_checkpoints)  # under torchrun: rank 0 writes

    def _restore(self) -> None:
        from dppo.run_files.run_dir import complete_checkpoints

        found = load_latest(self.run_dir)
        if found is None:
            tried = [p.name for p in complete_checkpoints(self.run_dir)]
            why = f"every checkpoint is corrupt (tried {', '.join(reversed(tried))})" if tried else "no complete checkpoint"
            raise ValueError(f"--resume: {why} under {self.run_dir / 'checkpoints'}")
        path, ckpt = found
        load_checkpoint_weights(self.model, ckpt["weights"], path, flag="--resume", dist=self.dist)
        load_optimizer(self.dist, self.model, self.optimizer, ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        st = ckpt["trainer_state"]
        self.step_idx = int(st["step"])
        self.sampler.position = int(st["sampler_position"])
        self.skipped_steps = int(st.get("skipped_steps", 0))
        set_rng_state(st["rng"])
        if self.dist.is_main:
            print(f"[dppo] resumed from {path} at step {self.step_idx}", flush=True)

    def close(self) -> None:
        """Stop the engine (or the rollout workers) and leave the process group; the trainer cannot train after it.
        Under DDP the wrapper goes first (its reducer holds the group). Under torchrun, close it (or use `with
        Trainer(...) as trainer:`) also when training raised, as `dppo train` does, so that the group is not left
        to interpreter exit."""
        if self._closed:
            return
        self._closed = True
        source = getattr(self, "source", None)  # (absent when __init__ failed before it)
        if source is not None:
            source.close()
        if isinstance(self.scorer, torch.nn.parallel.DistributedDataParallel):
            self.scorer = self.scorer.module
            gc.collect()
        self.dist.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_optimizer(params: list[Tensor], **hyper) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over all parameters) where torch has it: for SmolLM2-135M on CPU one step took
    0.35 s against 2.04 s for the default per-parameter loop (side by side, same gradients), the same update to
    float32 rounding (tests/test_trainer.py). Sharded (DTensor) parameters keep the default implementation."""
    from torch.distributed.tensor import DTensor

    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and not isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **hyper)


class _Accumulator:
    """Sums per-micro-batch stats as tensors; `result` divides once (no host sync until the step ends)."""

    def __init__(self, device: torch.device, max_staleness: int = 0, max_turns: int = 0) -> None:
        self.max_staleness = max_staleness  # the mismatch and masked fraction per staleness 0..k
        self.max_turns = max_turns  # ... and per turn 0..max_turns-1 of multi-turn episodes
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, Tensor] = {}
        self.ratio_max = torch.zeros((), device=device)
        self.grad_norms: list[Tensor] = []
        self.nonfinite_losses = torch.zeros((), device=device)
        self.hist = torch.zeros(len(metrics.MU_BUCKETS) + 1, device=device)

    def _add(self, key: str, value: Tensor, weight: Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0) + value.detach().float() * weight
        self.weights[key] = self.weights.get(key, 0) + weight

    def add_minibatch_loss(self, loss: Tensor) -> None:
        self._add("loss/policy", loss, torch.ones((), device=loss.device))

    def add_loss(self, stats: dict[str, Tensor]) -> None:
        n = stats["n_tokens"]
        for name, value, weight in metrics.loss_terms(stats):  # the loss's means, under `metrics.NAMES`
            self._add(name, value, weight)
        for key in metrics.SPLIT_KEYS:  # the mismatch split (loss.split_mismatch), per active token
            if key in stats:
                self._add(key, stats[key], n)
        self.ratio_max = torch.maximum(self.ratio_max, stats["ratio_max"].float())
        if "masked_mu_hist" in stats:
            self.hist += stats["masked_mu_hist"]
        for by in ("staleness", "turn"):
            if f"masked_by_{by}" in stats:
                n = stats[f"n_by_{by}"]
                frac = stats[f"masked_by_{by}"] / n.clamp(min=1)
                for j in range(n.shape[0]):
                    self._add(f"trust_region/masked_frac_{'stale' if by == 'staleness' else 'turn'}_{j}", frac[j], n[j])

    def add_mismatch(self, batch: RolloutBatch, micro: Tensor, scores) -> None:
        mask, logp, mu = batch.loss_mask[micro], scores.logp.detach(), batch.rollout_logp[micro]
        cells = scores.topk_logp is not None and batch.rollout_topk_logp is not None
        stats = metrics.mismatch_stats(
            logp, mu, mask, logp_cells=scores.topk_logp if cells else None,
            rollout_cells=batch.rollout_topk_logp[micro] if cells else None,
            cells_valid=batch.rollout_topk_valid[micro] if cells else None)
        n = stats.pop("n_tokens")
        for key, value in stats.items():
            self._add(f"mismatch/{key}", value, n)
        if scores.entropy is not None:
            self._add("policy/entropy", *metrics.token_mean(scores.entropy, mask))
        if "staleness" in batch.extras:  # (set by `step`; absent in a batch made by hand)
            total, count = metrics.per_group_sums(binary_tv(logp, mu), mask, batch.extras["staleness"][micro],
                                                  self.max_staleness + 1)
            for j in range(count.shape[0]):
                self._add(f"mismatch/binary_tv_stale_{j}", total[j] / count[j].clamp(min=1), count[j])
        if self.max_turns and "turn_index" in batch.extras:  # per turn of an episode (generated tokens only)
            turn = batch.extras["turn_index"][micro]
            total, count = metrics.per_group_sums(binary_tv(logp, mu), mask, turn, self.max_turns)
            for j in range(count.shape[0]):
                self._add(f"mismatch/binary_tv_turn_{j}", total[j] / count[j].clamp(min=1), count[j])
            if "token_staleness" in batch.extras:
                stale = batch.extras["token_staleness"][micro].float()
                total, count = metrics.per_group_sums(stale, mask, turn, self.max_turns)
                for j in range(count.shape[0]):
                    self._add(f"rollout/staleness_turn_{j}", total[j] / count[j].clamp(min=1), count[j])

    def add_grad_norm(self, grad_norm: Tensor, loss_finite: Tensor) -> None:
        self.grad_norms.append(grad_norm.float())
        self.nonfinite_losses = self.nonfinite_losses + (~loss_finite).float()

    def result(self) -> dict[str, Tensor]:
        out = {k: self.sums[k] / torch.as_tensor(self.weights[k]).clamp(min=1e-12) for k in self.sums}
        # the token count behind each per-turn value: `Trainer.step` drops the values of turns no episode reached
        out.update({f"count/{k}": torch.as_tensor(self.weights[k]) for k in self.sums if "_turn_" in k})
        out["ratio/max"] = self.ratio_max
        norms = torch.stack(self.grad_norms)
        out["optim/grad_norm"] = norms.mean()
        out["optim/nonfinite_grad_steps"] = (~torch.isfinite(norms)).float().sum()
        out["optim/nonfinite_loss_steps"] = self.nonfinite_losses
        out.update({f"trust_region/{k}": v for k, v in metrics.masked_mu_shares(self.hist).items()})
        return out


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
