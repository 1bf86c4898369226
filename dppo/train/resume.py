"""`dppo train --resume`: the newest loadable checkpoint of a run directory back into the model, the optimiser, the
learning-rate schedule and the RNGs (a corrupt checkpoint falls back to the one before it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from dppo.run_files.checkpoint import load_latest, load_optimizer, set_rng_state
from dppo.run_files.run_dir import complete_checkpoints
from dppo.train.distributed import Dist
from dppo.train.evaluation import load_checkpoint_weights


def restore(run_dir: Path, model: nn.Module, optimizer, scheduler, dist: Dist) -> tuple[Path, dict[str, Any]]:
    """Load the newest loadable checkpoint under `run_dir` into `model`, `optimizer` and `scheduler` and set the RNG
    state it saved; returns its path and the trainer state (step, sampler position, skipped steps). ValueError
    naming --resume when there is none or every one is corrupt."""
    found = load_latest(run_dir)
    if found is None:
        tried = [p.name for p in complete_checkpoints(run_dir)]
        why = f"every checkpoint is corrupt (tried {', '.join(reversed(tried))})" if tried else "no complete checkpoint"
        raise ValueError(f"--resume: {why} under {run_dir / 'checkpoints'}")
    path, ckpt = found
    load_checkpoint_weights(model, ckpt["weights"], path, flag="--resume", dist=dist)
    load_optimizer(dist, model, optimizer, ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    state = ckpt["trainer_state"]
    set_rng_state(state["rng"])
    return path, state
