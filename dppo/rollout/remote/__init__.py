"""Rollout workers outside the trainer's process (rollout.mode async): the transports.

`POOLS` maps rollout.backend to its transport: `local` (processes on this machine, shared-memory weights;
`dppo.rollout.remote.local`) and `ray` (Ray actors, placeable on other nodes; `dppo.rollout.remote.ray_actors`).
`start_pool(backend, specs, devices, ...)` starts one worker per device, worker i building engine i mod M from its
`EngineSpec`. The scheduling (bounded staleness) is `dppo.rollout.async_source`; the checks of an async set-up
against the run config are the trainer's (`dppo.train.rollout_build.check_rollout`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from dppo.rollout.remote.pool import Pool, WorkerError
from dppo.rollout.remote.worker import Request, Result, worker_threads
from dppo.rollout.spec import EngineSpec

POOLS: dict[str, str] = {
    "local": "dppo.rollout.remote.local:LocalPool",
    "ray": "dppo.rollout.remote.ray_actors:RayPool",
}
"""rollout.backend -> "module:Class" (imported when used)."""


def start_pool(backend: str, specs: Sequence[EngineSpec], devices: list[str], weights: dict, version: int, *,
               threads: int = 0, timeout_s: float = 600.0, seed_offset: int = 0, in_flight: bool = False,
               address: str = "") -> Pool:
    """Start the workers of `backend` on `devices`, each holding `weights` as version `version`. Worker i holds
    engine i mod M of the run's engine specs and seeds it with spec.seed + seed_offset + i (torchrun rank r passes seed_offset 1000·r). threads: CPU threads
    per CPU worker (0 = the cores shared between the trainer and the CPU workers)."""
    if backend not in POOLS:
        raise ValueError(f"rollout.backend: unknown {backend!r}; valid: {', '.join(POOLS)}")
    module, cls = POOLS[backend].split(":")
    pool_cls = getattr(importlib.import_module(module), cls)
    threads = worker_threads(threads, sum(d == "cpu" for d in devices))
    extra = {"address": address} if backend == "ray" else {}
    return pool_cls(specs, devices, threads=threads, timeout_s=timeout_s, weights=weights, version=version,
                    seed_offset=seed_offset, in_flight=in_flight, **extra)


__all__ = ["POOLS", "Pool", "Request", "Result", "WorkerError", "start_pool"]
