"""A rollout worker: one engine in its own process (or Ray actor), with versioned weights.

The trainer sends `Request`s (examples + sampling parameters of one share of a step's batch, and the run's
environment); the worker collects their episodes and answers each with a `Result` holding the rollouts (scored by
the trainer's source when they arrive), every one stamped with the **published weight version** it was sampled
under (`Rollout.weight_version`: the number of optimiser steps behind those weights). Between two
requests the worker loads the newest published weights, so a request submitted when version v was published is
sampled with version >= v: that is what bounds the staleness (dppo.train.async_rollouts).

`WorkerCore` holds the engine and does the work; the transports (`dppo.rollout.remote.local`,
`dppo.rollout.remote.ray_actors`) only move requests, results and weights. The engine is built from the same
`EngineSpec` as an in-process engine (`dppo.rollout.spec.build_engine`; the worker's own device and seed), so fp8,
LoRA-merged weights and the engine choice behave the same in both modes; its weights are then replaced by the
published ones before the first request. A worker never sees the run config.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dppo.rollout.base import Rollout, SamplingParams
from dppo.rollout.source import Episodes, stamp
from dppo.rollout.spec import EngineSpec, build_engine


@dataclass
class Request:
    """One share of a step's prompts for one worker."""

    id: int
    step: int
    """The training step whose batch this is (-1 for evaluation)."""
    examples: Sequence
    """The task examples of this share."""
    params: SamplingParams
    episodes: Episodes
    """The run's episodes (`dppo.rollout.source.Episodes`): their collector runs the episodes of `examples`."""


@dataclass
class Result:
    """The answer to a request (or to the start-up handshake, id -1)."""

    id: int
    worker: int
    rollouts: list[Rollout] = field(default_factory=list)
    error: str | None = None
    """The worker's traceback when the request failed (the trainer raises it, naming the worker)."""
    version: int = -1
    """The weight version the request was sampled under."""
    busy_s: float = 0.0
    """Seconds spent generating this request."""
    load_s: float = 0.0
    """Seconds spent loading newer weights before it."""
    info: dict[str, Any] = field(default_factory=dict)
    engine_metrics: dict[str, float] = field(default_factory=dict)
    """The worker's engine's counters after the request (`Engine.metrics`: run totals, e.g. server restarts)."""


def worker_threads(requested: int, cpu_workers: int) -> int:
    """CPU threads per CPU worker: `requested`, or (0) the cores shared between the trainer and the CPU workers."""
    if requested:
        return requested
    return max(1, (os.cpu_count() or 1) // (cpu_workers + 1))


def worker_spec(specs: Sequence[EngineSpec], index: int, device: str, seed_offset: int = 0) -> EngineSpec:
    """The spec of worker `index` on `device`: engine index mod M of the run's engine specs (worker i holds engine
    i mod M), with the worker's device and engine seed spec.seed + seed_offset + index (workers, and torchrun ranks
    through seed_offset, sample differently)."""
    spec = specs[index % len(specs)]
    return dataclasses.replace(spec, device=device, seed=spec.seed + seed_offset + index)


class WorkerCore:
    """The engine of worker `index`, built from its `EngineSpec`, with versioned weight loading (an engine with a
    `lag` holds each published version back until `lag` newer ones are published)."""

    def __init__(self, spec: EngineSpec, index: int, threads: int) -> None:
        if spec.device == "cpu":
            torch.set_num_threads(threads)
        self.index, self.device, self.lag, self.engine_index = index, spec.device, spec.lag, spec.index
        self.engine = build_engine(spec)
        self.version = -1  # the version the engine holds (its rollouts carry it)
        self.published = -1  # the newest version this worker was given
        self._kept: dict[int, dict] = {}  # lag: versions not loaded yet (CPU copies)
        self.generating, self.in_flight_load_s = False, 0.0
        self._collectors: dict = {}  # repr(environment) -> its collector (an environment factory built once)

    def load(self, version: int, weights) -> float:
        """Take published weights `version` (a state dict): load them, or with a lag k (and past the first load) the
        newest version given that is at most `version` - k; returns the seconds it took."""
        t0 = time.perf_counter()
        self.published = max(self.published, version)
        target, state = version, weights
        if self.lag and self.version >= 0:
            self._kept[version] = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
            ready = [v for v in self._kept if self.version < v <= version - self.lag]
            target, state = (max(ready), self._kept[max(ready)]) if ready else (self.version, None)
        if state is not None:
            self.engine.load_weights(state)
            self.version = self.engine.weight_version = target  # the rollouts carry the published version
        for old in [v for v in self._kept if v <= self.version]:
            del self._kept[old]
        seconds = time.perf_counter() - t0
        self.in_flight_load_s += seconds if self.generating else 0.0
        return seconds

    def enable_in_flight(self, poll) -> None:
        """In-flight updates: `poll()` (which loads newer weights through `load` if any, returning True when it did)
        is called by the engine between decode chunks."""
        self.engine.between_chunks = poll

    def run(self, request: Request, load_s: float = 0.0) -> Result:
        """Generate one request; an exception becomes a Result carrying its traceback."""
        t0, start_version = time.perf_counter(), self.version
        self.generating, self.in_flight_load_s = True, 0.0
        try:
            key = repr(request.episodes)
            if key not in self._collectors:
                self._collectors[key] = request.episodes.collector()
            rollouts = self._collectors[key](self.engine, request.examples, request.params)
        except Exception:  # noqa: BLE001 - reported to the trainer, which raises it naming this worker
            return Result(request.id, self.index, error=traceback.format_exc(), version=self.version)
        finally:
            self.generating = False
        # the version that started each response (in-flight updates: the engine's token_versions say more)
        stamp(rollouts, start_version, in_flight=self.engine.between_chunks is not None)
        for r in rollouts:
            r.engine = self.engine_index
        load_s += self.in_flight_load_s
        return Result(request.id, self.index, rollouts, version=start_version,
                      busy_s=time.perf_counter() - t0 - self.in_flight_load_s, load_s=load_s,
                      engine_metrics=self.engine.metrics())

    def close(self) -> None:
        self.engine.close()
