"""The rollout from a resolved `Config`: the `EngineSpec` of each of the run's engines (`rollout.engines`), the
in-process engine built from it, the checks of the rollout set-up on this machine, and the trainer's rollout source
(an engine in this process, or rollout workers).

This is where the run config ends for the rollout: below it, engines, workers and sources take an `EngineSpec`
(carrying the chosen engine's own settings node as it is, looked up in `dppo.rollout.settings.ENGINES`) and explicit
arguments.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from dppo.rollout.async_source import AsyncSource
from dppo.rollout.fleet import fleet_of
from dppo.rollout.remote import start_pool
from dppo.rollout.settings import Adapter
from dppo.rollout.source import EngineSource
from dppo.rollout.spec import EngineSpec
from dppo.train.build import model_spec
from dppo.train.config import Config, ConfigError
from dppo.train.resolve import resolve_device, resolve_engines


ENGINE_SEED_STRIDE = 7919
"""Engine j's seed: train.seed + rank + j·ENGINE_SEED_STRIDE (engine 0's is the run's seed)."""


def engine_specs(cfg: Config, *, device: str | None = None, seed_offset: int = 0,
                 run_dir: Path | None = None) -> list[EngineSpec]:
    """One `EngineSpec` per engine of a resolved run config (`dppo.train.resolve.resolve_config`), in order: what an
    in-process engine and every rollout worker are built from, each engine's settings node carried as it is, with
    its dtype, fp8, lag, index and its own seed. device: the engines' (default: the trainer's). run_dir: where an
    engine with server processes writes their logs (<run_dir>/servers, engine j of several in
    <run_dir>/servers/engine_{j}; default a temporary folder)."""
    r, m = cfg.rollout, cfg.model
    adapter = Adapter(m.lora_rank, m.lora_alpha, tuple(m.lora_target_modules)) if m.lora_rank else None
    nodes = resolve_engines(cfg)  # ("as configured" for a resolved config)
    logs = [None if run_dir is None else Path(run_dir) / "servers" / (f"engine_{j}" if len(nodes) > 1 else "")
            for j in range(len(nodes))]
    return [EngineSpec(model_spec(cfg), settings=node.settings, dtype=node.dtype,
                       device=device or resolve_device(m.device).type,
                       seed=cfg.train.seed + seed_offset + ENGINE_SEED_STRIDE * j, top_k_logprobs=cfg.top_k_logprobs,
                       quantization="fp8" if node.fp8 else "none", log_dir=log and str(log), adapter=adapter,
                       versions_in_flight=r.max_staleness + node.lag + 2 if r.mode == "async" else 2,
                       lag=node.lag, index=j)
            for j, (node, log) in enumerate(zip(nodes, logs))]


def engine_spec(cfg: Config, **kwargs) -> EngineSpec:
    """The `EngineSpec` of the run's first engine (`engine_specs`; the only one of most runs)."""
    return engine_specs(cfg, **kwargs)[0]


def build_rollout_engine(cfg: Config, *, seed_offset: int = 0, run_dir: Path | None = None):
    """The run's in-process engines with the initial weights of the model, as one engine (`fleet_of`: one engine is
    itself, several a `FleetEngine`)."""
    return fleet_of(engine_specs(cfg, seed_offset=seed_offset, run_dir=run_dir))


def check_rollout(cfg: Config, trainer_device: torch.device) -> None:
    """ConfigError naming the field for a rollout set-up that cannot work on this machine, before any model
    loads: rollout.mode async with a device this machine does not have, or Ray not installed (what the engine can
    do is checked with the config, `dppo.train.kinds.check_engines`)."""
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
    """async: one device per rollout worker: rollout.devices, or one worker per engine on the trainer's device type."""
    return cfg.rollout.device_list or [trainer_device.type] * len(cfg.rollout.engines)


def build_source(cfg: Config, episodes, *, draw, weights: dict[str, torch.Tensor], version: int, position: int,
                 device: torch.device, rank: int = 0, announce=None, run_dir: Path | None = None):
    """The trainer's `RolloutSource` for rollout.mode, running `episodes` (`build_episodes`) and holding `weights`
    as version `version`: the engines in this process (sync; each its `lag` versions behind) or rollout workers
    (async; worker i holds engine i mod M). draw(step) -> `Draw`: the trainer's prompt draw; position: the prompt sampler's position now.
    announce: called with the workers' line (the engine choice is announced by the caller, from the config as the
    user gave it: `announce_rollout`)."""
    r = cfg.rollout
    if r.mode == "sync":  # ranks sample differently: engine seed train.seed + rank
        engine = build_rollout_engine(cfg, seed_offset=rank, run_dir=run_dir)
        return EngineSource(engine, draw, weights=weights, version=version, start_position=position,
                            lags=[n.lag for n in r.engines], episodes=episodes)

    pool = start_pool(r.backend, engine_specs(cfg, run_dir=run_dir), worker_devices(cfg, device), weights, version,
                      threads=r.worker_threads, timeout_s=r.worker_timeout_s, seed_offset=1000 * rank,
                      in_flight=r.in_flight_updates, address=r.ray_address)
    if announce is not None:
        announce(f"[dppo] rollout: async, max_staleness {r.max_staleness}, {r.backend} backend, "
                 + "; ".join(pool.name(i) for i in range(len(pool.devices))))
    return AsyncSource(pool, draw, max_staleness=r.max_staleness, max_lag=r.max_lag, start_step=version,
                       start_position=position, episodes=episodes)
