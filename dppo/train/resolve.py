"""The run config resolved on this machine: every `auto` decided once, with its reason, and every path made
absolute, so a run directory's config.yaml says exactly what the run used and resumes the same anywhere.

`resolve_node` and `resolve_precision` are the one place the engine, the engine dtype and the training precision
are decided (`dppo.runtime.hardware` gives the reasons); `resolve_config` writes their values into the config, and
everything after it (the engine spec, the rollout checks, the workers) reads the resolved config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dppo.episodes.settings import EPISODE_KINDS
from dppo.rollout.settings import EngineNode
from dppo.runtime import hardware
from dppo.runtime.hardware import describe
from dppo.runtime.models import BUILTIN_MODELS
from dppo.runtime.plugins import absolute_spec
from dppo.train.config import Config, replace


def resolve_device(name: str) -> torch.device:
    """The trainer's device for model.device (auto: cuda when available, else cpu)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: {name!r} requested but CUDA is not available")
    return device


def resolve_node(node: EngineNode, device: torch.device) -> tuple:
    """(engine, engine dtype, warning or None) of one engine of rollout.engines on this machine: kind and dtype
    `auto` resolved by `dppo.runtime.hardware`, each with its reason."""
    dtype, warning = hardware.resolve_dtype(node.dtype, device)
    return hardware.resolve_engine(node.kind, dtype.value, device), dtype, warning


def resolve_engines(cfg: Config) -> tuple[EngineNode, ...]:
    """The run's engines with no `auto` left (an engine auto becomes the chosen kind with its defaults)."""
    device = resolve_device(cfg.model.device)
    resolved = []
    for node in cfg.rollout.engines:
        engine, dtype, _ = resolve_node(node, device)
        settings = node.settings if engine.value == node.kind else None
        resolved.append(dataclasses.replace(node, kind=engine.value, dtype=dtype.value, settings=settings))
    return tuple(resolved)


def resolve_precision(cfg: Config) -> tuple:
    """(training precision, warning or None) for this machine: `model.precision: auto` resolved by
    `dppo.runtime.hardware.resolve_precision` (bf16 autocast where bf16 is native), with its reason."""
    return hardware.resolve_precision(cfg.model.precision, resolve_device(cfg.model.device), cfg.model.dtype)


TASK_PATHS = {"file": ("path", "eval_path")}
"""Per task, its options that name a file it reads (an episode kind's files: its settings' `absolute_paths`)."""


def absolute_paths(cfg: Config, base: Path) -> Config:
    """`cfg` with every file the run reads made absolute against `base` (the directory the run starts in): a local
    model folder, the `file` task's data files, plug-in files (`path/to/file.py:name` as task or reward) and the
    files each episode kind's settings name (`absolute_paths` of its class: an environment or agent file, a verifiers
    taskset file or folder). A run directory's config.yaml then works from any directory (`--resume`, `dppo eval
    --run-dir`, `dppo export`); a moved file is an error naming its absolute path. Registry names,
    `package.module:name` specs and paths already absolute are left as they are (idempotent)."""
    t = cfg.task
    task: dict = {"name": absolute_spec(t.name, base), "reward": absolute_spec(t.reward, base)}
    if t.name in TASK_PATHS:
        options = t.options_dict
        given = {k: options[k] for k in TASK_PATHS[t.name] if isinstance(options.get(k), str)}
        if any(not Path(v).expanduser().is_absolute() for v in given.values()):
            task["options"] = json.dumps({**options, **{k: str((base / Path(v).expanduser()).resolve())
                                                         for k, v in given.items()}})
    model = cfg.model.name
    if model not in BUILTIN_MODELS and not Path(model).expanduser().is_absolute() and (base / model).exists():
        model = str((base / model).resolve())
    kinds = {kind: getattr(cfg, kind).absolute_paths(base) for kind in EPISODE_KINDS if hasattr(cfg, kind)}
    return dataclasses.replace(replace(cfg, model={"name": model}, task=task), **kinds)


def resolve_config(cfg: Config) -> Config:
    """`cfg` with every value the run will use written out: rollout.engine, rollout.dtype and model.precision as
    `auto` chose them on this machine (the chosen engine then checked like a configured one,
    `dppo.train.kinds.check_engine`: a setting of another engine, or what it cannot do, is refused naming the
    field), rollout.top_k_logprobs as K (20 or 0 when unset), and the loss as its resolved `LossSpec`
    (`LossConfig.spec`: the chosen trust region's parameters, the sequence mask's δ and DRPO's δ at their defaults when unset). A run
    directory's config.yaml holds this, and a resumed run reads exactly it (idempotent: resolving it again changes
    nothing). Every file the run reads is an absolute path (`absolute_paths`, against the current directory); with
    an environment or an agent, task.reward is '' (the episodes score themselves: a reward given is not used, and
    the run says so at start, `resolution_notes`)."""
    precision, _ = resolve_precision(cfg)
    cfg = replace(absolute_paths(cfg, Path.cwd()), model={"precision": precision.value})
    if not cfg.episode_settings.scored_by_task:  # the environment / agent scores each episode: task.reward unused
        cfg = replace(cfg, task={"reward": ""})
    return replace(cfg, rollout={"engines": resolve_engines(cfg), "top_k_logprobs": cfg.top_k_logprobs},
                   loss=cfg.loss.spec().to_dict())


def announce_rollout(cfg: Config, announce, *, training: bool = False) -> None:
    """Say which engine and dtype `auto` chose and why (and the emulated-bf16 warning), or with several engines each
    under the index its metrics carry (`engine_{j}`, with the warning of each emulated-bf16 one); `training`: the
    training precision too (the trainer's start; evaluation and tools only sample)."""
    device = resolve_device(cfg.model.device)
    chosen = [resolve_node(node, device) for node in cfg.rollout.engines]
    precision, precision_warning = resolve_precision(cfg) if training else (None, None)
    trained = f"; training precision {precision.value} ({precision.reason})" if precision else ""
    if len(chosen) == 1:
        (engine, dtype, _), = chosen
        line = describe(engine, dtype, precision)
    else:
        line = "[dppo] rollout: engines " + ", ".join(
            f"engine_{j} = {dataclasses.replace(node, kind=e.value, dtype=d.value, settings=None).describe()}"
            for j, (node, (e, d, _)) in enumerate(zip(cfg.rollout.engines, chosen))) + trained
    warnings = dict.fromkeys(w for _, _, w in chosen if w)
    for text in (line, *(f"[dppo] warning: {w}" for w in warnings), precision_warning and f"[dppo] warning: {precision_warning}"):
        if text and announce is not None:
            announce(text)


def resolution_notes(requested: Config) -> list[str]:
    """What resolving `requested` set aside that its user should hear at start (the trainer prints each line)."""
    settings, task = requested.episode_settings, requested.task
    notes = []
    if not settings.scored_by_task and task.reward:
        notes.append(f"[dppo] task.reward {task.reward!r} is not used: {settings.noun} {settings.label!r} scores "
                     f"each episode (config.yaml records reward '')")
    unused = [f"task.{k}" for k in ("name", "options", "system_prompt") if getattr(task, k) != getattr(type(task)(), k)]
    if settings.supplies_examples and unused:
        notes.append(f"[dppo] {' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used: the "
                     f"{settings.noun} {settings.label!r} supplies the run's examples (task.size, task.eval_size and "
                     f"task.seed split them)")
    return notes
