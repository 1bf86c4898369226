"""The DPPO training loop: rollout → reward → advantage → E×M updates → publish weights → log.

`Trainer.step` reads top to bottom, the same in every sampling mode: the batch comes from a `RolloutSource`
(`dppo.rollout.source`: an engine in this process, engines some versions behind (their `lag`), or rollout
workers that sample ahead, up to rollout.max_staleness versions behind), and the new weights are published to it
as the next version. Each response records the version that sampled it, so its staleness is measured. The
importance weight of every update is π/µ against the engine's recorded log-probs; the trust-region mask is
anchored at µ (or at the recomputed π_old when `loss.anchor = "recompute"`, which costs one extra no-grad
forward). Mini-batches after the first are off-policy by construction — what the trust region is for. All
metrics stay tensors until the end of an optimiser step (one host sync per optimiser step, for the
finite-gradient check) and of a training step.
"""

from __future__ import annotations

import gc
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dppo.advantages import compute_advantages
from dppo.divergence import topk_kl, topk_tv
from dppo.episodes.results import episode_rewards, episode_success
from dppo.losses import LOSSES, aggregation_denominator
from dppo.rewards.runner import NonFiniteRewardError
from dppo.rollout.base import SamplingParams
from dppo.rollout.source import Draw
from dppo.run_files.checkpoint import save_training_checkpoint
from dppo.run_files.logger import RunLogger
from dppo.runtime.faults import fault_point
from dppo.train.batch import (RolloutBatch, collate, episode_groups, group_strata, loss_inputs, minibatches,
                              stamp_staleness)
from dppo.train.batch_stats import mini_batch_statistics
from dppo.train.build import build_episodes, build_model, build_scorer, build_task, check_environment, seed_everything
from dppo.train.config import Config
from dppo.train.rollout_build import build_source, check_rollout
from dppo.train.distributed import init_from_env
from dppo.train.evaluation import eval_line, evaluate, vote_rule
from dppo.train.optim import GuardedOptimizer
from dppo.train.prompts import PromptSampler
from dppo.train.resolve import announce_rollout, resolution_notes, resolve_config, resolve_device
from dppo.train.resume import restore
from dppo.train.scoring import Scores, autocast_dtype, score_batch
from dppo.train.step_metrics import StepAccumulator, loss_diagnostics, prune_unreached, samples, step_metrics
from dppo.train.stopping import GracefulStop
from dppo.train.timing import StepTimer
from dppo.train.weights import engine_state



class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False) -> None:
        """`self.cfg` is `cfg` resolved (`dppo.train.resolve.resolve_config`: engine, dtype, K and the trust region's
        parameters as this run uses them), which `dppo train` saves as the run directory's config.yaml."""
        self.cfg, self.run_dir = resolve_config(cfg), Path(run_dir)
        requested, cfg = cfg, self.cfg
        self.dist = init_from_env(cfg, resolve_device(cfg.model.device))  # under torchrun: join the process group
        self._closed = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed)
        check_rollout(cfg, resolve_device(cfg.model.device))  # before any model loads
        self.task = build_task(cfg)  # validates data before any model is loaded
        self.train_examples, self.eval_examples = list(self.task.train), list(self.task.eval)
        env_line = check_environment(cfg, self.train_examples)  # env settings fail here, before any model loads
        self.episodes = build_episodes(cfg, self.task)  # every response is an episode of the run's environment
        self.model, self.tokenizer, _ = build_model(cfg, self.run_dir)
        self.scorer = build_scorer(cfg, self.model, self.dist)  # DDP/FSDP2 under torchrun (FSDP2 shards self.model)
        self.loss_spec = cfg.loss.spec()  # resolved and checked once (dppo.loss_spec)
        self.loss_fn = LOSSES[self.loss_spec.loss]
        region = self.loss_spec.region
        self.topk_divergence = {"topk_tv": topk_tv, "topk_kl": topk_kl}[region.divergence] if region.needs_topk else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = next(self.model.parameters()).device
        self.autocast = autocast_dtype(cfg.model.precision, next(self.model.parameters()).dtype)  # None = fp32
        o = cfg.optim
        self.optim = GuardedOptimizer(self.model, self.params, self.dist, lr=o.lr, betas=o.betas,
                                      weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, grad_clip=o.grad_clip,
                                      max_consecutive_skips=cfg.train.max_consecutive_skips, grad_snr=cfg.log.grad_snr,
                                      announce=lambda line: self.logger.print(line), loss_scaling=cfg.model.precision == "fp16")
        self.optimizer, self.scheduler = self.optim.optimizer, self.optim.scheduler
        self.step_idx = 0
        self.sampler = PromptSampler(len(self.train_examples), cfg.train.seed)
        self._log_write_s = 0.0  # seconds the logger took to write the previous step's metrics
        if resume:
            self._restore()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stop_ids = tuple(sorted({i for i in [self.tokenizer.eos_token_id] if i is not None}))
        self.logger = RunLogger.for_run(self.run_dir, cfg, start_step=self.step_idx, active=self.dist.is_main)
        announce = lambda line: print(line, flush=True) if self.dist.is_main else None  # noqa: E731
        announce_rollout(requested, announce, training=True)  # what `auto` chose and why (the resolved config only says what)
        for line in (*resolution_notes(requested), env_line):
            if line:
                announce(line)
        # the engine (or the rollout workers) holding the current weights as version step_idx; with
        # an engine's lag: a resumed run's lag restarts from the resumed weights
        self.source = build_source(cfg, self.episodes, draw=self._draw, weights=self._engine_state(),
                                   version=self.step_idx, position=self.sampler.position, device=self.device,
                                   rank=self.dist.rank, announce=announce, run_dir=self.run_dir)

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
                batch = stamp_staleness(cpu_batch.to(self.device), self.step_idx)  # trained by version step_idx
            with timer.time("reward"):
                rewards, reward_stats = episode_rewards(rollouts)
                success = episode_success(rollouts, rewards).to(self.device)  # reward/accuracy, as pass@1
                rewards = rewards.to(self.device)
                completions = [r.episode.completion for r in rollouts]
        except Exception as exc:  # noqa: BLE001 - agreed below: raised on every rank (one process: re-raised)
            failure = exc
        skip = self.dist.agree(failure, skip=NonFiniteRewardError)
        if skip is not None:  # a broken reward (on any rank): no update from this batch
            return self._skip_step(skip, t_start)
        with timer.time("reward"):  # after the agreement: under torchrun a collective (the global batch's rewards)
            adv, adv_stats = self._advantages(rewards, batch.episode)  # per row, its episode's
            batch.reward = rewards[batch.episode]  # per row (the ledger's surrogate)
        with timer.time("recompute"):
            old = self._recompute(batch) if cfg.loss.anchor == "recompute" or cfg.loss.split_mismatch else None
        with timer.time("training"):
            update_stats = self._update(batch, adv, old, timer)
        with timer.time("sync"):
            self._publish_weights()
        self.step_idx += 1
        source_stats = self.source.metrics()
        with timer.time("metrics"):
            self.logger.log_samples(self.step_idx, samples(completions, rewards, batch, examples,
                                                           self.cfg.log.samples_per_step))
            values = step_metrics(batch, rewards, success, reward_stats, adv_stats, update_stats,
                                  lr=self.scheduler.get_last_lr()[0], skipped_steps=self.optim.skipped_steps,
                                  max_staleness=self.source.max_staleness, engines=len(cfg.rollout.engines),
                                  adv=adv, group_size=cfg.rollout.group_size)
            values.update(self.optim.metrics())  # (fp16: the loss scale and the overflows)
            metrics = prune_unreached(self.dist.reduce_metrics(values), self.source.max_staleness)  # the one sync
            metrics.update(self.episodes.metrics(rollouts))  # (episode/*: multi-turn environments only)
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
    def _sampling_params(self, step: int, *, n: int | None = None, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.group_size if n is None else n,
            temperature=r.temperature if temperature is None else temperature,
            max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids,
            top_k_logprobs=self.cfg.top_k_logprobs,  # (evaluation too: an agent's client sees the same top_logprobs)
            seed=self.cfg.train.seed * 100_003 + step + (self.dist.rank << 32),  # ranks sample differently
        )

    def _score(self, batch: RolloutBatch, idx: Tensor, *, grad: bool, with_entropy: bool = False):
        """π's log-probs (and top-K cells, entropy) for the sequences `idx` of the batch."""
        return score_batch(self.scorer, batch, idx, grad=grad, with_entropy=with_entropy, pad_id=self.pad_id,
                           temperature=self.cfg.rollout.temperature, autocast=self.autocast)

    def _publish_weights(self) -> None:
        """After a training step: its weights become version step_idx + 1 of the source (versions count steps)."""
        self.source.publish(self.step_idx + 1, self._engine_state())

    def _engine_state(self) -> dict[str, Tensor]:
        """The weights an engine loads, as a state dict (LoRA merged; under FSDP2 a collective)."""
        return engine_state(self.model, self.dist, adapter=self.cfg.rollout.takes_adapter)

    def _recompute(self, batch: RolloutBatch) -> Scores:
        """π_old's scores of the whole batch before any update (the recompute anchor), one micro-batch at a time."""
        idx = torch.arange(batch.response_ids.shape[0], device=self.device)
        parts = [self._score(batch, micro, grad=False) for micro in idx.split(self.cfg.train.micro_batch_size)]
        return Scores(*(None if part[0] is None else torch.cat(part) for part in zip(*parts)))

    def _advantages(self, rewards: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Advantages of this rank's episodes over the global batch (under torchrun every rank gathers all ranks'
        rewards: batch-level statistics are global), given to each row (`rows`: each row's episode)."""
        a = self.cfg.advantage
        every = self.dist.all_gather_rows(rewards)
        adv, stats = compute_advantages(a.estimator, every, self.cfg.rollout.group_size)
        n = rewards.shape[0]
        return adv[self.dist.rank * n:(self.dist.rank + 1) * n][rows], stats

    def _update(self, batch: RolloutBatch, adv: Tensor, old, timer: StepTimer | None = None) -> dict[str, Any]:
        cfg = self.cfg
        timer = timer or StepTimer(cuda=self.device.type == "cuda")
        acc = StepAccumulator(self.device, self.source.max_staleness, self.episodes.max_turns,
                              len(cfg.rollout.engines)).begin(batch, old)  # (π_old: every row's mismatch)
        first, groups = True, episode_groups(batch, cfg.rollout.group_size)
        strata = group_strata(batch, groups)  # fleet members: the first mini-batch holds each
        for epoch in range(cfg.train.epochs):
            for mb in minibatches(groups, cfg.train.mini_batches, seed=cfg.train.seed, step=self.step_idx, epoch=epoch,
                                  device=self.device, strata=strata):
                denom = self.dist.global_denominator(aggregation_denominator(batch.loss_mask[mb], cfg.loss.aggregation))
                batch_stats = mini_batch_statistics(self.loss_spec, batch, mb, old, score=self._score, dist=self.dist,
                                                    micro_batch_size=cfg.train.micro_batch_size, device=self.device)
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
                        self.optim.backward(loss)  # a non-finite loss still backpropagates; the step is then skipped
                    with timer.time("loss"):
                        loss_finite &= torch.isfinite(loss.detach())
                        mb_loss = mb_loss + loss.detach().float()
                        acc.add_loss(stats)
                        if first:  # before any update of this step: the entropy (without π_old the mismatch)
                            acc.add_before_update(batch, micro, scores)
                with timer.time("optimizer"):
                    grad_norm = self.optim.step(loss_finite, self.step_idx + 1)
                fault_point("update", self.step_idx + 1)
                acc.add_grad_norm(grad_norm, loss_finite)
                acc.add_minibatch_loss(mb_loss)
                first = False
        return {**acc.result(), **self.optim.pop_noise()}

    def _loss(self, batch, micro, scores, adv, old, denom, batch_stats=None):
        """The loss of one micro-batch (a `dppo.losses.LOSSES` entry) and its metrics. `old` (π_old's scores) is the
        recompute anchor, or with anchor rollout only the reference of the mismatch split (loss.split_mismatch);
        `batch_stats`: the mini-batch's statistics the trust region reads (`mini_batch_statistics`)."""
        inputs = loss_inputs(batch, micro, scores, old if self.cfg.loss.anchor == "recompute" else None,
                             topk_divergence=self.topk_divergence, n_turns=self.episodes.max_turns,
                             batch_stats=batch_stats)
        loss, stats = self.loss_fn(scores.logp, batch.rollout_logp[micro], adv[micro], batch.loss_mask[micro],
                                   self.loss_spec, inputs, max_response_len=self.episodes.max_tokens, denominator=denom)
        stats = loss_diagnostics(stats, batch, micro, scores.logp, None if old is None else old.logp[micro],
                                 max_staleness=self.source.max_staleness, max_turns=self.episodes.max_turns,
                                 engines=len(self.cfg.rollout.engines), adv=adv[micro])
        return loss, stats

    def _skip_step(self, reason: str, t_start: float) -> dict[str, float]:
        """A step whose rewards were non-finite: no update, counted like a skipped optimiser step."""
        self.optim.skip(self.step_idx + 1, culprit=f"reward ({reason})")
        self._publish_weights()  # the unchanged weights become the next version (versions count steps)
        self.step_idx += 1
        return {"reward/nonfinite_steps": 1.0, "optim/skipped_steps_total": float(self.optim.skipped_steps),
                "perf/step_s": time.perf_counter() - t_start}

    # ------------------------------------------------------------------ eval and checkpoints
    def evaluate(self, examples=None, *, temperature: float | None = None) -> dict[str, float]:
        """Sampled pass@1 (pass@k and maj@k with several responses each) and mean reward on held-out examples."""
        examples = self.eval_examples if examples is None else examples
        temp = temperature or self.cfg.train.eval_temperature or self.cfg.rollout.temperature
        params = self._sampling_params(10_000_000 + self.step_idx, n=self.cfg.train.eval_samples_per_prompt,
                                       temperature=temp)
        return self.dist.evaluate(  # each rank evaluates its share of the examples
            lambda share: evaluate(self.source, share, params, pad_id=self.pad_id, vote=vote_rule(self.task.reward)), examples)

    def evaluate_and_log(self) -> dict[str, float]:
        result = self.evaluate()
        self.logger.log_eval(self.step_idx, result)
        self.logger.print(eval_line(self.step_idx, result))
        return result

    def save(self) -> Path:
        # rank 0 writes (torchrun); the sampler position after the last trained batch: a resume redraws any in flight
        state = {"sampler_position": self.source.trained_position, **self.optim.state_dict()}
        return save_training_checkpoint(self.dist, self.run_dir, self.step_idx, model=self.model, optimizer=self.optimizer,
                                         scheduler=self.scheduler, trainer_state=state, keep=self.cfg.train.keep_checkpoints)

    def _restore(self) -> None:
        path, st = restore(self.run_dir, self.model, self.optimizer, self.scheduler, self.dist)
        self.step_idx, self.sampler.position = int(st["step"]), int(st["sampler_position"])
        self.optim.load_state_dict(st)
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
