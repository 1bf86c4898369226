"""The rollout from a resolved `Config`: the `EngineSpec` of the run's engine (or of each member of its fleet), the
in-process engine built from it, the checks of the rollout set-up on this machine, and the trainer's rollout source
(an engine in this process, or rollout workers).

This is where the run config ends for the rollout: below it, engines, workers and sources take an `EngineSpec`
(carrying the chosen engine's own settings node as it is, looked up in `dppo.rollout.settings.ENGINES`) and explicit
arguments.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import torch

from dppo.rollout.async_source import AsyncSource
from dppo.rollout.fleet import FleetEngine, FleetMember
from dppo.rollout.remote import start_pool
from dppo.rollout.settings import ENGINES, Adapter
from dppo.rollout.source import EngineSource
from dppo.rollout.spec import EngineSpec, build_engine
from dppo.train.build import model_spec
from dppo.train.config import Config, ConfigError
from dppo.train.resolve import resolve_device, resolve_rollout


def engine_spec(cfg: Config, *, device: str | None = None, seed_offset: int = 0, run_dir: Path | None = None,
                member: FleetMember | None = None):
    """The `EngineSpec` of a resolved run config (`dppo.train.resolve.resolve_config`): what an in-process engine
    and every rollout worker are built from, the chosen engine's settings node carried as it is. device: the
    engine's (default: the trainer's). run_dir: where an engine with server processes writes their logs
    (<run_dir>/servers; default a temporary folder). member: a fleet member's spec instead (its kind's node, its
    dtype and fp8; `fleet_specs`)."""
    r, m = cfg.rollout, cfg.model
    if member is None:
        engine, dtype, _ = resolve_rollout(cfg)  # "as configured" for a resolved config
        member = FleetMember(engine.value, dtype.value, fp8=r.quantization == "fp8")
    adapter = Adapter(m.lora_rank, m.lora_alpha, tuple(m.lora_target_modules)) if m.lora_rank else None
    return EngineSpec(model_spec(cfg), settings=getattr(r, ENGINES[member.kind].node()), dtype=member.dtype,
                      device=device or resolve_device(m.device).type, seed=cfg.train.seed + seed_offset,
                      top_k_logprobs=cfg.top_k_logprobs, quantization="fp8" if member.fp8 else "none",
                      log_dir=str(Path(run_dir) / "servers") if run_dir is not None else None, adapter=adapter,
                      versions_in_flight=r.max_staleness + 2 if r.mode == "async" else 2)


FLEET_SEED_STRIDE = 7919
"""Fleet member j's engine seed: train.seed + rank + j·FLEET_SEED_STRIDE."""


def fleet_specs(cfg: Config, *, seed_offset: int = 0, run_dir: Path | None = None) -> list:
    """One `EngineSpec` per member of rollout.fleet, in order (each with its own seed and, for a member with server
    processes, its own log folder <run_dir>/servers/engine_{j})."""
    specs = [engine_spec(cfg, seed_offset=seed_offset + FLEET_SEED_STRIDE * j, run_dir=run_dir, member=member)
             for j, member in enumerate(cfg.rollout.fleet_members)]
    return [dataclasses.replace(s, log_dir=s.log_dir and str(Path(s.log_dir) / f"engine_{j}"))
            for j, s in enumerate(specs)]


def build_rollout_engine(cfg: Config, *, seed_offset: int = 0, run_dir: Path | None = None):
    """The run's in-process engine with the initial weights of the model: its fleet (`FleetEngine`, rollout.fleet) or
    its one engine (`engine_spec`)."""
    if cfg.rollout.fleet:
        return FleetEngine.from_specs(fleet_specs(cfg, seed_offset=seed_offset, run_dir=run_dir))
    return build_engine(engine_spec(cfg, seed_offset=seed_offset, run_dir=run_dir))


def check_rollout(cfg: Config, trainer_device: torch.device) -> None:
    """ConfigError naming the field for a rollout set-up that cannot work on this machine, before any model
    loads: rollout.mode async with a device this machine does not have, or Ray not installed (what the engine can
    do is checked with the config, `dppo.train.kinds.check_engine`)."""
    r = cfg.rollout
    if r.mode != "async":
        return
    if r.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("rollout.backend: 'ray' needs the ray package (pip install -r requirements/integrations.txt)")
    if r.backend == "local":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device in worker_devices(cfg, trainer_device):
            index = int(device.split(":")[1]) if ":" in device else 0
            if device.startswith("cuda") and index >= gpus:
                raise ConfigError(f"rollout.devices: {device!r} does not exist on this machine "
                                  f"({gpus} CUDA device(s))")


def worker_devices(cfg: Config, trainer_device: torch.device) -> list[str]:
    """async: one device per rollout worker: rollout.devices, or one worker on the trainer's device type."""
    return cfg.rollout.device_list or [trainer_device.type]


def build_source(cfg: Config, episodes, *, draw, weights: dict[str, torch.Tensor], version: int, position: int,
                 device: torch.device, rank: int = 0, announce=None, run_dir: Path | None = None):
    """The trainer's `RolloutSource` for rollout.mode, running `episodes` (`build_episodes`) and holding `weights`
    as version `version`: an engine in this process (sync; `rollout.engine_lag` versions behind) or rollout workers
    (async). draw(step) -> `Draw`: the trainer's prompt draw; position: the prompt sampler's position now.
    announce: called with the workers' line (the engine choice is announced by the caller, from the config as the
    user gave it: `announce_rollout`)."""
    r = cfg.rollout
    if r.mode == "sync":  # ranks sample differently: engine seed train.seed + rank
        engine = build_rollout_engine(cfg, seed_offset=rank, run_dir=run_dir)
        return EngineSource(engine, draw, weights=weights, version=version, start_position=position, lag=r.engine_lag,
                            episodes=episodes)

    pool = start_pool(r.backend, engine_spec(cfg, run_dir=run_dir), worker_devices(cfg, device), weights, version,
                      threads=r.worker_threads, timeout_s=r.worker_timeout_s, seed_offset=1000 * rank,
                      in_flight=r.in_flight_updates, address=r.ray_address)
    if announce is not None:
        announce(f"[dppo] rollout: async, max_staleness {r.max_staleness}, {r.backend} backend, "
                 + "; ".join(pool.name(i) for i in range(len(pool.devices))))
    return AsyncSource(pool, draw, max_staleness=r.max_staleness, start_step=version, start_position=position,
                       episodes=episodes)
