"""Rollout workers outside the trainer's process (rollout.mode async): transports and their checks.

`POOLS` maps rollout.backend to its transport: `local` (processes on this machine, shared-memory weights;
`dppo.rollout.remote.local`) and `ray` (Ray actors, placeable on other nodes; `dppo.rollout.remote.ray_actors`).
`check_async(cfg)` refuses what cannot work before any model loads; `start_pool(cfg, ...)` starts the workers.
The trainer-side scheduling (bounded staleness) is `dppo.train.async_rollouts`.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from dppo.rollout.remote.pool import Pool, WorkerError
from dppo.rollout.remote.worker import Request, Result, worker_threads

POOLS: dict[str, str] = {
    "local": "dppo.rollout.remote.local:LocalPool",
    "ray": "dppo.rollout.remote.ray_actors:RayPool",
}
"""rollout.backend -> "module:Class" (imported when used)."""


def worker_devices(cfg, trainer_device: torch.device) -> list[str]:
    """One device per worker: rollout.devices, or one worker on the trainer's device type."""
    return cfg.rollout.device_list or [trainer_device.type]


def check_async(cfg, trainer_device: torch.device) -> None:
    """ConfigError naming the field for an async set-up that cannot work, before any model loads: a device this
    machine does not have (local backend), an engine that cannot receive weights, Ray not installed."""
    from dppo.rollout import engine_class
    from dppo.train.build import resolve_rollout
    from dppo.train.config import ConfigError

    r = cfg.rollout
    if r.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("rollout.backend: 'ray' needs the ray package (pip install -r requirements/integrations.txt)")
    if r.backend == "local":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device in worker_devices(cfg, trainer_device):
            if device.startswith("cuda"):
                index = int(device.split(":")[1]) if ":" in device else 0
                if index >= gpus:
                    raise ConfigError(f"rollout.devices: {device!r} does not exist on this machine "
                                      f"({gpus} CUDA device(s))")
    engine, _, _ = resolve_rollout(cfg)
    if r.in_flight_updates and engine.value != "hf":
        raise ConfigError(f"rollout.in_flight_updates: needs the hf engine (rollout.engine auto chose {engine.value!r} "
                          f"here; set rollout.engine hf)")
    cls = engine_class(engine.value)
    if not callable(getattr(cls, "load_weights", None)):
        raise ConfigError(f"rollout.engine: {engine.value!r} cannot receive weights (no load_weights), which "
                          f"rollout.mode async needs after every optimiser step")


def start_pool(cfg, devices: list[str], weights: dict, version: int, *, rank: int = 0) -> Pool:
    """Start the workers of rollout.backend on `devices`, each holding `weights` as version `version`. Worker i of
    torchrun rank r seeds its engine with train.seed + 1000·r + i (ranks and workers sample differently)."""
    module, cls = POOLS[cfg.rollout.backend].split(":")
    pool_cls = getattr(importlib.import_module(module), cls)
    r = cfg.rollout
    threads = worker_threads(r.worker_threads, sum(d == "cpu" for d in devices))
    extra = {"address": r.ray_address} if r.backend == "ray" else {}
    return pool_cls(cfg, devices, threads=threads, timeout_s=r.worker_timeout_s, weights=weights, version=version,
                    seed_offset=1000 * rank, **extra)


__all__ = ["POOLS", "Pool", "Request", "Result", "WorkerError", "check_async", "start_pool", "worker_devices"]
