"""A model as vLLM loads it: a folder with config.json and safetensors weights, its EOS ids and parameter shapes,
and the check of a state dict against them. Shared by the in-process `vllm` engine and the `vllm-server` engine
(neither imports vLLM here)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from dppo.runtime import models

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def save_on_any_rank(model, folder: str) -> None:
    """What vLLM needs of `model.save_pretrained(folder)`, written by this process whatever its rank: config,
    generation config, and the weights as one safetensors file (a tied lm-head left out, as transformers does)."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, f"{folder}/model.safetensors",
              metadata={"format": "pt"})

def model_folder(model, tokenizer, tmpdir: str | None) -> tuple[Path, object]:
    """(folder vLLM loads, tokenizer): a module is saved to `tmpdir`; a name/path is resolved (ValueError if
    missing); the tokenizer defaults to the folder's, if it has one."""
    if isinstance(model, nn.Module):
        if not hasattr(model, "save_pretrained"):
            raise ValueError("model: a module must be a transformers PreTrainedModel (it is saved for vLLM)")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            save_on_any_rank(model, tmpdir)  # save_pretrained writes nothing on ranks other than 0
        else:
            model.save_pretrained(tmpdir)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmpdir)
        return Path(tmpdir), tokenizer
    path = models.resolve_model_path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json (not a transformers model folder)")
    if tokenizer is None and has_tokenizer(path):
        tokenizer = models.load_tokenizer(path)
    return path, tokenizer

def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))

def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)

def eos_ids(path: Path, config: dict, tokenizer) -> set[int]:
    """The tokenizer's EOS plus the generation config's (generation_config.json, else config.json)."""
    ids: set[int] = set()
    gen = path / "generation_config.json"
    values = [getattr(tokenizer, "eos_token_id", None)]
    values.append(read_json(gen).get("eos_token_id") if gen.is_file() else config.get("eos_token_id"))
    for value in values:
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return {int(i) for i in ids}

def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, from the folder's safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    if not shapes:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    return shapes

def strip_prefixes(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def checked_items(weights: Mapping[str, Tensor] | nn.Module, shapes: dict[str, tuple[int, ...]], *, tied: bool,
                  dtype: torch.dtype) -> list[tuple[str, Tensor]]:
    """(name, tensor in `dtype`) for every entry of a state dict (or a module's), checked against the checkpoint's
    `shapes`: names may carry a ``module.``/``_orig_mod.`` prefix (DDP, torch.compile), a subset may be given, a
    tied ``lm_head.weight`` is skipped; an unknown name or a wrong shape is a ValueError before anything loads."""
    if isinstance(weights, nn.Module):
        weights = weights.state_dict()
    items = []
    for name, value in weights.items():
        key = strip_prefixes(name)
        if key == "lm_head.weight" and tied and key not in shapes:
            continue
        if key not in shapes:
            raise ValueError(f"weights: unknown parameter name {name!r} for this model")
        if tuple(value.shape) != shapes[key]:
            raise ValueError(f"weights: {name!r} has shape {tuple(value.shape)}, expected {shapes[key]}")
        items.append((key, value.detach().to(dtype=dtype)))
    return items
