"""`AsyncSource`: the `RolloutSource` of rollout.mode async — bounded-staleness scheduling of rollout workers in
other processes (`dppo.rollout.remote`: local processes or Ray actors).

Weight versions: version v = the weights after v optimiser steps of the run (published after every training
step; a step skipped for non-finite rewards publishes the unchanged weights under the next version). The batch
of training step s (0-based) is trained by the weights of version s, so a response sampled under version w has
**staleness s − w**. With rollout.max_staleness k, the batch of step s is submitted as soon as version s − k is
published (and sampled with that version or a newer one), so every trained response has staleness <= k:

    version published:   0          1          2          3
    submitted (k = 1):   batches 0, 1   batch 2    batch 3    batch 4
    trained:             step 0 (s=0)   step 1 (s≤1)   step 2 (s≤1) ...

k = 0 is the synchronous schedule (submit step s after version s, wait), so it reproduces `rollout.mode sync`
with the engine in another process. A worker whose engine has a lag L (`EngineNode.lag`) samples with weights L
versions older than those it was given, so its responses' staleness is at most k + L (`max_lag`: the bound `take`
checks). Each batch is split into one share of whole prompts per worker; shares
after the first get their own sampling seed. Prompts are drawn when a batch is submitted; `trained_position`
is the prompt sampler's position after the last *trained* batch, which a checkpoint stores, so a resumed run
draws the in-flight batches again (they are dropped, not trained twice or skipped).

`generate(examples, params)` (evaluation) is split over the workers like a batch and waits for its own results,
filing any training results that arrive meanwhile. The workers collect the run's episodes (the environment
travels with each request); the results are scored here, in the trainer's process (`RolloutSource.take`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dppo.rollout.base import Rollout, SamplingParams
from dppo.rollout.remote import Pool, Request
from dppo.rollout.source import Draw, RolloutSource

_SEED_STRIDE = 1 << 40  # added to the sampling seed per share after the first


@dataclass
class _Pending:
    step: int
    examples: list
    position_after: int
    shares: dict[int, tuple[int, list[Rollout] | None]] = field(default_factory=dict)  # request id -> (offset, rollouts)

    @property
    def complete(self) -> bool:
        return all(r is not None for _, r in self.shares.values())

    def rollouts(self) -> list[Rollout]:
        out = []
        for offset, rollouts in sorted(self.shares.values(), key=lambda x: x[0]):
            for r in rollouts:
                r.prompt_index += offset
                out.append(r)
        return out


class AsyncSource(RolloutSource):
    """Steps in flight against a worker `Pool` that holds version `start_step` (see the module docstring)."""

    def __init__(self, pool: Pool, draw: Callable[[int], Draw], *, max_staleness: int, start_step: int,
                 start_position: int, episodes, max_lag: int = 0) -> None:
        super().__init__(draw, start_position=start_position, episodes=episodes)
        self.pool, self.ahead = pool, max_staleness
        self.max_staleness = max_staleness + max_lag  # (an engine's lag adds to the staleness its responses have)
        self.weight_version = start_step
        self._next_step = start_step
        self._pending: dict[int, _Pending] = {}
        self._owner: dict[int, _Pending] = {}
        self._ids = 0
        self._busy = [0.0] * len(pool.devices)
        self._load = [0.0] * len(pool.devices)
        self._engine_metrics: dict[int, dict[str, float]] = {}  # worker -> its engine's counters (latest)
        self._since = time.perf_counter()
        self.last_wait_s = 0.0

    # ------------------------------------------------------------------ training batches
    def _take(self, step: int):
        """(examples, rollouts, position) of training step `step`, after submitting every batch the staleness bound
        allows."""
        while self._next_step <= self.weight_version + self.ahead:
            d = self.draw(self._next_step)
            pending = _Pending(self._next_step, d.examples, d.position)
            self._submit(pending, d.examples, d.params)
            self._pending[self._next_step] = pending
            self._next_step += 1
        pending = self._pending.pop(step)
        t0 = time.perf_counter()
        self._wait(pending)
        self.last_wait_s = time.perf_counter() - t0
        return pending.examples, pending.rollouts(), pending.position_after

    def publish(self, version: int, weights: dict) -> None:
        """Publish the weights after `version` optimiser steps to every worker."""
        self.pool.publish(version, weights)
        self.weight_version = version

    def metrics(self) -> dict[str, float]:
        """The trainer's wait for this step's batch (its share of the time since the previous call), each worker's
        idle share and weight-load seconds since the previous call (averaged over workers), and the counters of the
        workers' engines (`Engine.metrics`, each worker's latest, added up: e.g. server/restarts)."""
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        n = len(self._busy)
        out = {"async/trainer_wait_s": self.last_wait_s, "async/trainer_idle_frac": self.last_wait_s / elapsed,
               "async/worker_idle_frac": sum(max(0.0, 1 - (b + w) / elapsed) for b, w in zip(self._busy, self._load)) / n,
               "async/worker_load_s": sum(self._load) / n}
        self._busy, self._load, self._since = [0.0] * n, [0.0] * n, time.perf_counter()
        for counters in self._engine_metrics.values():  # the workers' engines' counters, added up
            for key, value in counters.items():
                out[key] = out.get(key, 0.0) + value
        return out

    # ------------------------------------------------------------------ evaluation
    def _generate(self, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        pending = _Pending(-1, [], -1)
        self._submit(pending, examples, params)
        self._wait(pending)
        return pending.rollouts()

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, pending: _Pending, examples: Sequence, params: SamplingParams) -> None:
        W = min(len(self.pool.devices), len(examples))
        bounds = [len(examples) * i // W for i in range(W + 1)]
        for part in range(W):
            lo, hi = bounds[part], bounds[part + 1]
            share = params if part == 0 or params.seed is None else dataclasses.replace(
                params, seed=params.seed + part * _SEED_STRIDE)
            self._ids += 1
            pending.shares[self._ids] = (lo, None)
            self._owner[self._ids] = pending
            self.pool.submit(part, Request(self._ids, pending.step, list(examples[lo:hi]), share, self.episodes))

    def _wait(self, pending: _Pending) -> None:
        while not pending.complete:
            result = self.pool.get(timeout=1.0)
            if result is None:
                continue
            owner = self._owner.pop(result.id)
            offset, _ = owner.shares[result.id]
            owner.shares[result.id] = (offset, result.rollouts)
            self._busy[result.worker] += result.busy_s
            self._load[result.worker] += result.load_s
            self._engine_metrics[result.worker] = result.engine_metrics
