"""Build the trainer's parts from a resolved `Config` (`dppo.train.resolve`): task, reward runner, policy model
(+LoRA), scorer and the episodes (the rollout's engines and source: `dppo.train.rollout_build`).

This is where the run config ends: below it, engines, workers and sources take an `EngineSpec` (carrying the chosen
engine's own settings node as it is) and explicit arguments; components are looked up in their registries, never
branched on by name. The weights an engine loads (`engine_state`) come from `dppo.train.weights`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dppo.rewards import RewardRunner
from dppo.runtime import models
from dppo.runtime.models import ModelSpec, tiny_dims
from dppo.tasks import TASKS, make_task
from dppo.train.config import Config
from dppo.train.distributed import decoder_layers
from dppo.train.resolve import resolve_device
from dppo.train.scoring import ScoringModule, packed_layout_supported



def build_task(cfg: Config):
    """The run's task: the examples of its episode kind when the kind supplies them (a verifiers taskset's tasks,
    `EpisodeKindSettings.task`), else the task section's task; split by task.size, task.eval_size and task.seed."""
    t, settings = cfg.task, cfg.episode_settings
    try:
        task = (settings.task(size=t.size, eval_size=t.eval_size, seed=t.seed) if settings.supplies_examples
                else _make_task(cfg))
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith(f"{cfg.rollout.episodes}.") else f"task: {exc}") from exc
    if not task.train:
        raise ValueError(f"task: {task.name!r} produced no training examples")
    if len(task.eval) > t.eval_size:  # a task that holds out its own rows (a file, a plug-in): the first eval_size
        task = dataclasses.replace(task, eval=task.eval[:t.eval_size])  # 0 = no evaluation; the rest stay held out
    return task


def _make_task(cfg: Config):
    """The task section's task (`dppo.tasks.make_task`)."""
    t = cfg.task
    options = dict(t.options_dict)
    accepted = _task_parameters(t.name)
    for key, value in (("size", t.size), ("eval_size", t.eval_size), ("seed", t.seed),
                       ("system_prompt", t.system_prompt or None)):
        if value is not None and (accepted is None or key in accepted):
            options.setdefault(key, value)
    if t.reward:
        options["reward"] = t.reward
    return make_task(t.name, **options)


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


def seed_everything(seed: int) -> None:
    """Seed `random`, numpy and torch (every device) with `seed`: what `transformers.set_seed` does, without importing
    transformers' trainer utilities (and peft through them: ~2.5 s at every process start)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_spec(cfg: Config):
    """The `ModelSpec` of the run's policy (what an engine loads to hold the same architecture)."""
    dims = tiny_dims(cfg.model.name)
    if dims is None:
        return ModelSpec(cfg.model.name, seed=cfg.train.seed)
    return ModelSpec("tiny-random", tiny_hidden=dims[0], tiny_layers=dims[1], seed=cfg.train.seed)


def build_model(cfg: Config, run_dir: Path | None = None):
    """The policy (trainable, in train mode), its tokenizer, and its folder (None for tiny-random)."""
    m = cfg.model
    model, tokenizer, path = models.load(model_spec(cfg), dtype=models.DTYPES[m.dtype])
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


def build_episodes(cfg: Config, task=None):
    """The run's episodes (`dppo.rollout.source.Episodes`) of its kind (rollout.episodes): the kind's settings (the
    config section of its name; the single answer has none) with the run-time values every kind is given — the
    longest answer (rollout.max_new_tokens), the run's model (model.name: a kind that tokenises on its own side
    loads its tokenizer), the recording proxy's settings (the `proxy` section: a kind that `uses_proxy` plays through
    it) and, for a kind scored by the task, `task`'s reward runner (task None: episodes that only collect)."""
    settings = cfg.episode_settings
    if settings.torchrun_refusal and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(settings.torchrun_refusal)
    reward = build_reward_runner(cfg, task) if task is not None and settings.scored_by_task else None
    return settings.episodes(max_new_tokens=cfg.rollout.max_new_tokens, reward=reward, model=cfg.model.name,
                             proxy=cfg.proxy)


def check_environment(cfg: Config, examples) -> str | None:
    """Before any model loads: the environment exists, takes its options, and its reset() answers the first training
    example with well-formed messages (ValueError naming env.name otherwise; a field of the kind's section when the
    error names one). Returns the environment's start-up line (the python tool's sandbox layer), if it has one."""
    try:
        return build_episodes(cfg).check(examples[0])
    except (TypeError, ValueError, KeyError) as err:
        section = f"{cfg.rollout.episodes}."
        raise ValueError(str(err) if str(err).startswith(section) else f"{section}name: {err}") from err
