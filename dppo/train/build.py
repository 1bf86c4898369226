"""Build the trainer's parts from a `Config`: task, reward runner, policy model (+LoRA), rollout engine.

Also the two weight helpers the trainer needs: `trainable_state` (what a checkpoint stores) and
`sync_weights` (the trainer's current weights, LoRA merged, pushed into the engine).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dppo.train.config import Config
from dppo.trust_region import DEFAULT_TOP_K

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_task(cfg: Config):
    from dppo.tasks import make_task

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
    return task


def _task_parameters(name: str) -> set[str] | None:
    """The keyword options a task builder accepts (None = it takes any)."""
    import inspect

    from dppo.tasks import TASKS

    builder = TASKS.get(name)
    if builder is None:
        return None
    params = inspect.signature(builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def build_reward_runner(cfg: Config, task):
    from dppo.rewards import RewardRunner

    return RewardRunner(task.reward, timeout_s=cfg.task.reward_timeout_s, name=cfg.task.reward or None,
                        task=cfg.task.name)


def build_model(cfg: Config, run_dir: Path):
    """The policy (trainable, in train mode), its tokenizer, and a folder holding its initial weights
    (for path-based engines; None unless one is needed)."""
    from dppo.train import models

    m = cfg.model
    dtype = _DTYPES[m.dtype]
    if m.name == "tiny-random":
        tokenizer = models.char_tokenizer()
        heads = max(1, m.tiny_hidden // 32)  # head size 32: supported by every attention backend (vLLM CPU too)
        model = models.tiny_random_model(tokenizer, hidden_size=m.tiny_hidden, num_layers=m.tiny_layers,
                                         num_heads=heads, num_kv_heads=heads, seed=cfg.train.seed, dtype=dtype)
        path = None
    else:
        try:
            path = models.resolve_model_path(m.name)
        except ValueError as exc:
            raise ValueError(f"model.name: {exc}") from exc
        tokenizer = models.load_tokenizer(path)
        model = models.load_model(path, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
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
    from dppo.train.scoring import ScoringModule, packed_layout_supported

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

    from dppo.train.distributed import decoder_layers

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
    `dppo.train.hardware`, each with its reason."""
    from dppo.train import hardware

    device = resolve_device(cfg.model.device)
    dtype, warning = hardware.resolve_dtype(cfg.rollout.dtype, device)
    return hardware.resolve_engine(cfg.rollout.engine, dtype.value, device), dtype, warning


def build_engine(cfg: Config, model: nn.Module, tokenizer, model_path: Path | None, *, seed_offset: int = 0,
                 announce=None):
    """The rollout engine, holding a copy of `model`'s weights. seed_offset: added to the engine's seed (the
    rank in a multi-process run, so that ranks sample different responses). announce: called with the line
    that says which engine and dtype were chosen and why (and with the emulated-bf16 warning)."""
    from dppo.train.hardware import describe
    from dppo.rollout import make_engine

    r = cfg.rollout
    engine_choice, dtype_choice, warning = resolve_rollout(cfg)
    for line in (describe(engine_choice, dtype_choice), warning and f"[dppo] warning: {warning}"):
        if line and announce is not None:
            announce(line)
    name, dtype = engine_choice.value, dtype_choice.value
    top_k = cfg.top_k_logprobs
    if name == "hf":
        engine = make_engine("hf", model=merged_model_copy(model), tokenizer=tokenizer, dtype=_DTYPES[dtype],
                             seed=cfg.train.seed + seed_offset, copy=False, max_batch_rows=r.hf_max_batch_rows or None)
        if top_k > engine.max_logprobs:  # fail at start-up, not at the first generate
            raise ValueError(f"rollout.top_k_logprobs: {top_k} exceeds the hf engine's max_logprobs "
                             f"{engine.max_logprobs} (the vocabulary size)")
        return _quantized(cfg, engine, model)
    # vLLM loads from a folder: the built-in's folder when the weights are untouched, else the engine saves
    # the (merged) module to a temporary folder itself. Either way the trainer's weights are synced in.
    source = model_path if model_path is not None and not cfg.model.lora_rank else merged_model_copy(model)
    # On CUDA the engine shares the GPU with the trainer (a memory fraction); on CPU its KV cache is bounded in GB.
    extra = ({"gpu_memory_utilization": r.vllm_gpu_memory_utilization} if torch.cuda.is_available()
             else {"kv_cache_gb": r.vllm_kv_cache_gb})
    engine = make_engine("vllm", source, tokenizer, dtype=dtype, seed=cfg.train.seed + seed_offset,
                         max_logprobs=max(DEFAULT_TOP_K, top_k), **extra)
    if cfg.rollout.quantization == "none":
        sync_weights(engine, model)
    return _quantized(cfg, engine, model)


def _quantized(cfg: Config, engine, model: nn.Module):
    """The engine itself, or with rollout.quantization fp8 a `QuantizedEngine` holding the quantised weights."""
    if cfg.rollout.quantization == "none":
        return engine
    from dppo.rollout.quantize import QuantizedEngine

    engine = QuantizedEngine(engine, activations=cfg.rollout.fp8_activations)
    sync_weights(engine, model)
    return engine


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: every parameter that requires grad (LoRA: only the adapter)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model's weights with HF names; for a peft model the LoRA deltas are added to the base weights
    out of place (the trainer's model is not modified)."""
    if not hasattr(model, "get_base_model"):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            deltas[f"{name}.weight"] = delta
    out = {}
    for key, value in model.get_base_model().state_dict().items():
        if "lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        value = value.detach()
        if clean in deltas:
            value = value + deltas[clean].detach().to(value.dtype)
        out[clean] = value
    return out


def merged_model_copy(model: nn.Module) -> nn.Module:
    """A plain (non-peft) copy of the model with LoRA merged in, for engines that hold their own copy."""
    import copy

    copied = copy.deepcopy(model)
    return copied.merge_and_unload() if hasattr(copied, "get_base_model") else copied


def sync_weights(engine, model: nn.Module, dist=None) -> None:
    """Push the trainer's weights (LoRA merged) into the engine; under FSDP2 (`dist.sharded`) every rank gathers
    the full weights once (a collective) and loads them into its own engine."""
    engine.load_weights(engine_weights(model, dist))


def engine_weights(model: nn.Module, dist=None):
    """What the engine loads: the module itself, its LoRA-merged state dict, or under FSDP2 the gathered full
    weights (a collective: every rank must call it)."""
    if dist is not None and dist.sharded:
        from dppo.train.checkpoint import full_state

        return full_state(dist, model, trainable_only=False, rank0_only=False)
    return merged_state_dict(model) if hasattr(model, "get_base_model") else model
