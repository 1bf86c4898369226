"""The wall-clock time of each phase of a training step (`perf/<phase>_s`), with CUDA synchronised at each
boundary so that asynchronous kernels are charged to the phase that launched them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch


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

