"""A run's model as a Hugging Face folder that `from_pretrained`, `vllm serve` and `push_to_hub` take as it is,
with no dppo code: what `dppo export RUN_DIR [--step N] OUT [--merged]` writes (`dppo.cli.export_checkpoint`), and
the `hf/` folder `dppo train` writes into its final checkpoint.

Full fine-tuning: config.json, generation_config.json, model.safetensors (the trained weights, in the training
dtype), the tokenizer with its chat template. LoRA (`model.lora_rank > 0`): the PEFT adapter folder
(adapter_config.json, adapter_model.safetensors, the tokenizer), whose `base_model_name_or_path` is the base
model's folder (for tiny-random, built in process, the base model is written to `base/` inside the export); with
`merged=True` the base model with the adapter merged in, as a plain model folder.

`dppo.cli.export_checkpoint` rebuilds the model from the run's config.yaml exactly as the trainer built it
(`build_model`) and loads the checkpoint's weights into it, so under FSDP2 nothing is gathered again: a checkpoint
holds full tensors; `export_model` here writes it. The folder is written to a temporary sibling and renamed into
place (a killed export leaves no half folder), and a disk error is one `RunDirError` (`dppo.run_files.run_dir`).

The tiny-random model's character tokenizer is saved in an equivalent byte-level form: transformers 5 maps every
qwen2 folder to `Qwen2Tokenizer`, which rebuilds a byte-level BPE from the vocabulary and would drop the
character vocabulary's spaces and newlines. With the byte-level names of the same characters (space "Ġ", newline
"Ċ"; the other printable ASCII characters are their own names) and no merges, `AutoTokenizer` and
`PreTrainedTokenizerFast` both give the same ids as the trainer's tokenizer; only characters outside its
vocabulary differ (dropped instead of `<|unk|>`).
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path

from torch import nn

from dppo.run_files.run_dir import guard


def export_model(model: nn.Module, tokenizer, out: str | Path, *, merged: bool = False, base: Path | None = None,
                 run_dir: str | Path | None = None, advice: str | None = None) -> Path:
    """Write `model` (a transformers causal LM, or a peft model) and `tokenizer` as a Hugging Face folder `out`
    (see the module docstring). base: the base model's folder for a LoRA adapter (None: written to out/base).
    run_dir: named in a disk error (default: out's parent)."""
    out = Path(out)
    run_dir = Path(run_dir) if run_dir is not None else out.parent
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar between the run's lines
    try:
        with guard(run_dir, tmp, advice=advice or f"nothing was written to {out}; free space, then export again"):
            tmp.mkdir(parents=True)
            _save(model, tmp, out, merged=merged, base=base)
            portable_tokenizer(tokenizer).save_pretrained(tmp)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bar:
            hf_logging.enable_progress_bar()
    return out


def _save(model: nn.Module, tmp: Path, out: Path, *, merged: bool, base: Path | None) -> None:
    is_peft = hasattr(model, "get_base_model")
    if is_peft and merged:
        model = copy.deepcopy(model).merge_and_unload()
    elif is_peft:
        if base is None:  # built in process: the adapter needs a base folder beside it
            base = out.absolute() / "base"
            copy.deepcopy(model).unload().save_pretrained(tmp / "base")  # the base weights, the adapter removed
        model = copy.deepcopy(model)  # the caller's model keeps its peft config
        for config in model.peft_config.values():
            config.base_model_name_or_path = str(base)
        with warnings.catch_warnings():  # peft looks for the base's config at `base`, which exists once renamed
            warnings.filterwarnings("ignore", message="Could not find a config file")
            model.save_pretrained(tmp)
        return
    model.save_pretrained(tmp)


def portable_tokenizer(tokenizer):
    """`tokenizer` itself, or for dppo's character tokenizer (a WordLevel vocabulary of single characters) the
    equivalent byte-level tokenizer that `AutoTokenizer` loads unchanged for any model type (module docstring)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or json.loads(backend.to_str())["model"]["type"] != "WordLevel":
        return tokenizer
    specials = set(tokenizer.all_special_tokens)
    vocab = tokenizer.get_vocab()
    if any(len(t) != 1 for t in vocab if t not in specials):
        return tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    names = bytes_to_unicode()
    byte_level = {t if t in specials else "".join(names[b] for b in t.encode()): i for t, i in vocab.items()}
    new = Tokenizer(models.BPE(vocab=byte_level, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    new.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    new.decoder = decoders.ByteLevel()
    new.add_special_tokens([t for t, _ in sorted(((t, vocab[t]) for t in specials), key=lambda x: x[1])])
    out = PreTrainedTokenizerFast(tokenizer_object=new, pad_token=tokenizer.pad_token, eos_token=tokenizer.eos_token,
                                  bos_token=tokenizer.bos_token, unk_token=tokenizer.unk_token,
                                  padding_side=tokenizer.padding_side)
    out.chat_template = tokenizer.chat_template
    if out.get_vocab() != byte_level:
        raise RuntimeError(f"tokenizer: the byte-level form changed the ids ({len(out.get_vocab())} vs {len(vocab)})")
    return out
