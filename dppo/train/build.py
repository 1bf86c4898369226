"""Build the trainer's parts from a resolved `Config` (`dppo.train.resolve`): task, reward runner, policy model
(+LoRA), scorer, the episodes, and the rollout source (the engine spec it is built from, the checks of the rollout
set-up on this machine).

This is where the run config ends: below it, engines, workers and sources take an `EngineSpec` (carrying the chosen
engine's own settings node as it is) and explicit arguments; components are looked up in their registries, never
branched on by name. The weights an engine loads (`engine_state`) come from `dppo.train.weights`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
from pathlib import Path

import torch
from torch import nn

from dppo.rewards import RewardRunner
from dppo.rollout.async_source import AsyncSource
from dppo.rollout.fleet import FleetEngine, FleetMember
from dppo.rollout.remote import start_pool
from dppo.rollout.source import EngineSource
from dppo.rollout.settings import ENGINES, Adapter
from dppo.rollout.spec import EngineSpec, build_engine
from dppo.runtime import models
from dppo.runtime.models import ModelSpec
from dppo.tasks import TASKS, make_task
from dppo.train.config import Config, ConfigError
from dppo.train.distributed import decoder_layers
from dppo.train.resolve import resolve_device, resolve_rollout
from dppo.train.scoring import ScoringModule, packed_layout_supported

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_task(cfg: Config):
    t = cfg.task
    options = dict(t.options_dict)
    accepted = _task_parameters(t.name)
    for key, value in (("size", t.size), ("eval_size", t.eval_size), ("seed", t.seed),
                       ("system_prompt", t.system_prompt or None)):
        if value is not None and (accepted is None or key in accepted):
            options.setdefault(key, value)
    if t.reward:
        options["reward"] = t.reward
    try:
        task = make_task(t.name, **options)
    except ValueError as exc:
        raise ValueError(f"task: {exc}") from exc
    if not task.train:
        raise ValueError(f"task: {t.name!r} produced no training examples")
    if len(task.eval) > t.eval_size:  # a task that holds out its own rows (a file, a plug-in): the first eval_size
        task = dataclasses.replace(task, eval=task.eval[:t.eval_size])  # 0 = no evaluation; the rest stay held out
    return task


def _task_parameters(name: str) -> set[str] | None:
    """The keyword options a task builder accepts (None = it takes any)."""
    builder = TASKS.get(name)
    if builder is None:
        return None
    params = inspect.signature(builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def build_reward_runner(cfg: Config, task):
    return RewardRunner(task.reward, timeout_s=cfg.task.reward_timeout_s, name=cfg.task.reward or None,
                        task=cfg.task.name)


def model_spec(cfg: Config):
    """The `ModelSpec` of the run's policy (what an engine loads to hold the same architecture)."""
    m = cfg.model
    return ModelSpec(m.name, tiny_hidden=m.tiny_hidden, tiny_layers=m.tiny_layers, seed=cfg.train.seed)


def build_model(cfg: Config, run_dir: Path | None = None):
    """The policy (trainable, in train mode), its tokenizer, and its folder (None for tiny-random)."""
    m = cfg.model
    model, tokenizer, path = models.load(model_spec(cfg), dtype=_DTYPES[m.dtype])
    model.to(resolve_device(m.device))
    if m.gradient_checkpointing:  # non-reentrant: gradients reach LoRA adapters whose inputs need no grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = True
    if m.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha,
                                                 target_modules=list(m.lora_target_modules), lora_dropout=0.0))
    model.train()
    return model, tokenizer, path


def scoring_layout(cfg: Config, *, sharded: bool) -> str:
    """The scoring layout (`dppo.train.scoring`) for this run: train.scoring_layout, or for "auto": "packed" under
    gradient checkpointing (the "shared" layout needs the prompts' KV cache, which checkpointed layers drop),
    "shared" under FSDP2 (FSDP2 gathers a layer's weights at each call, so every rank must make the same number
    of decoder calls, which a per-rank "auto" choice would not guarantee), else "auto" (chosen per call)."""
    layout = cfg.train.scoring_layout
    if layout != "auto":
        return layout
    if cfg.model.gradient_checkpointing:
        return "packed"
    return "shared" if sharded else "auto"


def build_scorer(cfg: Config, model: nn.Module, dist) -> nn.Module:
    """What the trainer calls to score: `ScoringModule(model)` with this run's layout, wrapped by DDP or FSDP2
    under torchrun. FSDP2 shards `model`'s parameters in place (they become DTensors): `fully_shard` per
    decoder layer, then the root; DDP leaves `model` as it is."""
    layout = scoring_layout(cfg, sharded=dist.sharded)
    if layout == "packed" and not packed_layout_supported(model):
        field = "model.gradient_checkpointing" if cfg.train.scoring_layout == "auto" else "train.scoring_layout"
        raise ValueError(f"{field}: the packed scoring layout needs sdpa or eager attention "
                         f"(this model uses {model.config._attn_implementation!r})")
    scorer = ScoringModule(model, layout=layout)
    if not dist.enabled:
        return scorer
    if dist.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DistributedDataParallel(scorer, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dist.device_mesh())
    fully_shard(scorer, mesh=dist.device_mesh())
    return scorer


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


def build_episodes(cfg: Config, task=None):
    """The run's episodes (`dppo.rollout.source.Episodes`) of its kind (rollout.episodes): the kind's settings (the
    config section of its name; the single answer has none) with the run-time values every kind is given — the
    longest answer (rollout.max_new_tokens) and, for a kind scored by the task, `task`'s reward runner (task None:
    episodes that only collect)."""
    settings = cfg.episode_settings
    if settings.torchrun_refusal and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(settings.torchrun_refusal)
    reward = build_reward_runner(cfg, task) if task is not None and settings.scored_by_task else None
    return settings.episodes(max_new_tokens=cfg.rollout.max_new_tokens, reward=reward)


def check_environment(cfg: Config, examples) -> str | None:
    """Before any model loads: the environment exists, takes its options, and its reset() answers the first training
    example with well-formed messages (ValueError naming env.name otherwise). Returns the environment's start-up line
    (the python tool's sandbox layer), if it has one."""
    try:
        return build_episodes(cfg).check(examples[0])
    except (TypeError, ValueError, KeyError) as err:
        field = f"{cfg.rollout.episodes}.name"
        raise ValueError(str(err) if str(err).startswith(field) else f"{field}: {err}") from err
