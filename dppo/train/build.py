"""Build the trainer's parts from a `Config`: task, reward runner, policy model (+LoRA), scorer, and the rollout
source (the engine spec it is built from, the checks of the rollout set-up on this machine).

This is where the run config ends: below it, engines, workers and sources take an `EngineSpec` and explicit
arguments. The weights an engine loads (`engine_state`) come from `dppo.train.weights`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex

import importlib.util
import inspect
from pathlib import Path

import torch
from torch import nn

from dppo.episodes.settings import EPISODE_KINDS
from dppo.rewards import RewardRunner
from dppo.rollout import engine_class
from dppo.rollout.async_source import AsyncSource
from dppo.rollout.base import missing_engine_methods
from dppo.rollout.remote import start_pool
from dppo.rollout.source import EngineSource
from dppo.rollout.spec import EngineSpec
from dppo.rollout.spec import build_engine as from_spec
from dppo.runtime import hardware, models
from dppo.runtime.hardware import describe
from dppo.runtime.models import BUILTIN_MODELS, ModelSpec
from dppo.runtime.plugins import absolute_spec
from dppo.tasks import TASKS, make_task
from dppo.train.config import Config, ConfigError, replace
from dppo.train.distributed import decoder_layers
from dppo.train.scoring import ScoringModule, packed_layout_supported
from dppo.train.weights import engine_state

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: {name!r} requested but CUDA is not available")
    return device


def resolve_rollout(cfg: Config) -> tuple:
    """(engine, engine dtype, warning or None) for this machine: `rollout.engine/dtype: auto` resolved by
    `dppo.runtime.hardware`, each with its reason."""
    device = resolve_device(cfg.model.device)
    dtype, warning = hardware.resolve_dtype(cfg.rollout.dtype, device)
    return hardware.resolve_engine(cfg.rollout.engine, dtype.value, device), dtype, warning


def resolve_precision(cfg: Config) -> tuple:
    """(training precision, warning or None) for this machine: `model.precision: auto` resolved by
    `dppo.runtime.hardware.resolve_precision` (bf16 autocast where bf16 is native), with its reason."""
    return hardware.resolve_precision(cfg.model.precision, resolve_device(cfg.model.device), cfg.model.dtype)


FILE_TASK_PATHS = ("path", "eval_path")
"""The `file` task's options that name a file it reads."""


def absolute_paths(cfg: Config, base: Path) -> Config:
    """`cfg` with every file the run reads made absolute against `base` (the directory the run starts in): a local
    model folder, the `file` task's data files, and plug-in files (`path/to/file.py:name` as task, reward or
    environment). A run directory's config.yaml then works from any directory (`--resume`, `dppo eval --run-dir`,
    `dppo export`); a moved file is an error naming its absolute path. Registry names, `package.module:name` specs
    and paths already absolute are left as they are (idempotent)."""
    t = cfg.task
    task: dict = {"name": absolute_spec(t.name, base), "reward": absolute_spec(t.reward, base)}
    if t.name == "file":
        options = t.options_dict
        given = {k: options[k] for k in FILE_TASK_PATHS if isinstance(options.get(k), str)}
        if any(not Path(v).expanduser().is_absolute() for v in given.values()):
            task["options"] = json.dumps({**options, **{k: str((base / Path(v).expanduser()).resolve())
                                                         for k, v in given.items()}})
    model = cfg.model.name
    if model not in BUILTIN_MODELS and not Path(model).expanduser().is_absolute() and (base / model).exists():
        model = str((base / model).resolve())
    return replace(cfg, model={"name": model}, task=task, env={"name": absolute_spec(cfg.env.name, base)},
                   agent={"name": absolute_spec(cfg.agent.name, base)})


def resolve_config(cfg: Config) -> Config:
    """`cfg` with every value the run will use written out: rollout.engine, rollout.dtype and model.precision as
    `auto` chose them on this machine, rollout.top_k_logprobs as K (20 or 0 when unset), and the loss as its resolved `LossSpec`
    (`LossConfig.spec`: the chosen trust region's parameters, the sequence mask's δ and DRPO's δ at their defaults
    when unset; the parameters of the other trust regions stay as given). A run directory's config.yaml holds this,
    and a resumed run reads exactly it (idempotent: resolving it again changes nothing). Every file the run reads is
    an absolute path (`absolute_paths`, against the current directory); with an environment, task.reward is ''
    (the environment scores each episode, the sum of its turns' rewards: a reward given is not used, and the run
    says so at start, `resolution_notes`)."""
    engine, dtype, _ = resolve_rollout(cfg)
    precision, _ = resolve_precision(cfg)
    cfg = replace(absolute_paths(cfg, Path.cwd()), model={"precision": precision.value})
    if cfg.env.name or cfg.agent.name:  # the environment / agent scores each episode: task.reward is not used
        cfg = replace(cfg, task={"reward": ""})
    return replace(cfg, rollout={"engine": engine.value, "dtype": dtype.value, "top_k_logprobs": cfg.top_k_logprobs},
                   loss=cfg.loss.spec().to_dict())


def resolution_notes(requested: Config) -> list[str]:
    """What resolving `requested` set aside that its user should hear at start (the trainer prints each line)."""
    if requested.env.name and requested.task.reward:
        return [f"[dppo] task.reward {requested.task.reward!r} is not used: environment {requested.env.name!r} "
                f"scores each episode (config.yaml records reward '')"]
    if requested.agent.name and requested.task.reward:
        return [f"[dppo] task.reward {requested.task.reward!r} is not used: agent {requested.agent.name!r} "
                f"scores each episode (config.yaml records reward '')"]
    return []


def engine_spec(cfg: Config, *, device: str | None = None, seed_offset: int = 0, run_dir: Path | None = None):
    """The run's `EngineSpec` (engine and dtype resolved for this machine): what an in-process engine and every
    rollout worker are built from. device: the engine's (default: the trainer's). run_dir: where the servers of
    vllm-server write their logs (<run_dir>/servers; default a temporary folder)."""
    r = cfg.rollout
    engine, dtype, _ = resolve_rollout(cfg)
    vllm = ({"gpu_memory_utilization": r.vllm_gpu_memory_utilization} if torch.cuda.is_available()
            else {"kv_cache_gb": r.vllm_kv_cache_gb})  # on CUDA vLLM shares the GPU with the trainer
    if engine.value == "vllm-server":
        vllm = {"urls": tuple(r.server_url_list), "servers": r.servers, "partial": r.server_partial,
                "timeout_s": r.server_timeout_s, "start_timeout_s": r.server_timeout_s,
                "server_args": tuple(shlex.split(r.server_args)), "weights_dir": r.server_weights_dir or None,
                "kv_cache_gb": r.vllm_kv_cache_gb,
                "log_dir": str(Path(run_dir) / "servers") if run_dir is not None else None}
        if r.lora_sync == "adapter":  # adapter slots: the current one and those requests in flight still use
            m = cfg.model
            vllm["lora"] = {"r": m.lora_rank, "alpha": m.lora_alpha, "target_modules": tuple(m.lora_target_modules),
                            "max_loras": r.max_staleness + 2 if r.mode == "async" else 2}
    return EngineSpec(model_spec(cfg), kind=engine.value, dtype=dtype.value,
                      device=device or resolve_device(cfg.model.device).type, seed=cfg.train.seed + seed_offset,
                      top_k_logprobs=cfg.top_k_logprobs, quantization=r.quantization,
                      fp8_activations=r.fp8_activations, hf_max_batch_rows=r.hf_max_batch_rows,
                      vllm=vllm if engine.value in ("vllm", "vllm-server") else {})


def announce_rollout(cfg: Config, announce, *, training: bool = False) -> None:
    """Say which engine and dtype `auto` chose and why (and the emulated-bf16 warning); `training`: the training
    precision too (the trainer's start; evaluation and tools only sample)."""
    engine, dtype, warning = resolve_rollout(cfg)
    precision, precision_warning = resolve_precision(cfg) if training else (None, None)
    for line in (describe(engine, dtype, precision), warning and f"[dppo] warning: {warning}",
                 precision_warning and f"[dppo] warning: {precision_warning}"):
        if line and announce is not None:
            announce(line)


def check_rollout(cfg: Config, trainer_device: torch.device) -> None:
    """ConfigError naming the field for a rollout set-up that cannot work on this machine, before any model
    loads (rollout.mode async: a device this machine does not have, an engine that cannot receive weights, Ray
    not installed)."""
    r = cfg.rollout
    if r.mode != "async":
        return
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
    if r.in_flight_updates and engine.value not in ("hf", "vllm-server"):
        raise ConfigError(f"rollout.in_flight_updates: needs the hf or vllm-server engine (rollout.engine auto chose "
                          f"{engine.value!r} here; set rollout.engine hf)")
    if "load_weights" in missing_engine_methods(engine_class(engine.value)):
        raise ConfigError(f"rollout.engine: {engine.value!r} cannot receive weights (no load_weights), which "
                          f"rollout.mode async needs after every optimiser step")


def worker_devices(cfg: Config, trainer_device: torch.device) -> list[str]:
    """async: one device per rollout worker: rollout.devices, or one worker on the trainer's device type."""
    return cfg.rollout.device_list or [trainer_device.type]


def build_engine(cfg: Config, model: nn.Module, *, dist=None, seed_offset: int = 0, announce=None):
    """An in-process engine built from the run's spec, holding `model`'s weights (LoRA merged; under FSDP2 a
    collective). For evaluation and tools; the trainer's engine lives in its `RolloutSource`."""
    announce_rollout(cfg, announce)
    engine = from_spec(engine_spec(cfg, seed_offset=seed_offset))
    engine.load_weights(engine_state(model, dist))
    return engine


def build_source(cfg: Config, episodes, *, draw, weights: dict[str, torch.Tensor], version: int, position: int,
                 device: torch.device, rank: int = 0, announce=None, run_dir: Path | None = None):
    """The trainer's `RolloutSource` for rollout.mode, running `episodes` (`build_episodes`) and holding `weights`
    as version `version`: an engine in this process (sync; `rollout.engine_lag` versions behind) or rollout workers
    (async). draw(step) -> `Draw`: the trainer's prompt draw; position: the prompt sampler's position now.
    announce: called with the workers' line (the engine choice is announced by the caller, from the config as the
    user gave it: `announce_rollout`)."""
    r = cfg.rollout
    if r.mode == "sync":  # ranks sample differently: engine seed train.seed + rank
        engine = from_spec(engine_spec(cfg, seed_offset=rank, run_dir=run_dir))
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


def episode_kind(cfg: Config) -> str:
    """The run's episode kind (a key of `dppo.episodes.settings.EPISODE_KINDS`): an agent when `agent.name` is set,
    an environment's episodes when `env.name` is, else a single answer per prompt."""
    return "agent" if cfg.agent.name else "env" if cfg.env.name else "single"


def build_episodes(cfg: Config, task=None):
    """The run's episodes (`dppo.rollout.source.Episodes`) of its kind (`episode_kind`): the kind's settings (the
    config section of its name; the single answer has none) with the run-time values every kind is given — the
    longest answer (rollout.max_new_tokens), a row's response tokens (env.max_tokens) and, for a kind scored by
    the task, `task`'s reward runner (task None: episodes that only collect)."""
    kind = episode_kind(cfg)
    settings = getattr(cfg, kind, None) or EPISODE_KINDS[kind]()
    if settings.torchrun_refusal and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(settings.torchrun_refusal)
    reward = build_reward_runner(cfg, task) if task is not None and settings.scored_by_task else None
    return settings.episodes(max_new_tokens=cfg.rollout.max_new_tokens, max_tokens=cfg.env.max_tokens, reward=reward)


def check_environment(cfg: Config, examples) -> str | None:
    """Before any model loads: the environment exists, takes its options, and its reset() answers the first training
    example with well-formed messages (ValueError naming env.name otherwise). Returns the environment's start-up line
    (the python tool's sandbox layer), if it has one."""
    try:
        return build_episodes(cfg).check(examples[0])
    except (TypeError, ValueError, KeyError) as err:
        field = f"{episode_kind(cfg)}.name"
        raise ValueError(str(err) if str(err).startswith(field) else f"{field}: {err}") from err
