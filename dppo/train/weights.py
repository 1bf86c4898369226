"""The trained model's weights as the rest of the run takes them: `trainable_state` (what a checkpoint stores),
`merged_state_dict` (the full model, LoRA merged, out of place) and `engine_state` (what an engine loads: the
trainer publishes it to its rollout source after every optimiser step, and `build_engine` loads it).
"""

from __future__ import annotations

import torch
from torch import nn

from dppo.run_files.checkpoint import Ranks, full_state


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


def engine_state(model: nn.Module, dist: Ranks | None = None, *, adapter: bool = False) -> dict[str, torch.Tensor]:
    """The weights an engine loads, as a state dict with HF names: the model's own (views, no copy), LoRA merged
    (out of place), or under FSDP2 the gathered full weights (a collective: every rank must call it). adapter: only
    the LoRA adapter, with the names of a saved PEFT adapter (rollout.vllm_server.lora_sync adapter)."""
    if adapter:
        from peft import get_peft_model_state_dict

        if dist is not None and dist.sharded:
            raise ValueError("rollout.vllm_server.lora_sync: 'adapter' is not supported with a sharded (FSDP2) model")
        return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    if dist is not None and dist.sharded:
        return full_state(dist, model, trainable_only=False, rank0_only=False)
    return merged_state_dict(model)
