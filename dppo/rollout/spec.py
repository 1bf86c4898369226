"""Engines built from a spec: `EngineSpec` says everything an engine needs (model, kind, dtype, limits, seed,
quantisation), frozen and picklable, and `build_engine(spec)` is the one factory.

The trainer's process and a rollout worker in another process build their engines the same way, from the same
spec (`dppo.train.build.engine_spec` turns the run config into it), so an engine never sees the run config. The
engine is built with the architecture and initial weights of `spec.model`; its owner (a `RolloutSource`) then
loads the trainer's weights into it before the first generation. K (`top_k_logprobs`) is checked against the
engine's cap here, once, at build time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dppo.rollout import make_engine
from dppo.rollout.quantize import QuantizedEngine
from dppo.runtime.models import ModelSpec, load
from dppo.trust_region import DEFAULT_TOP_K

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine, resolved (no `auto` left)."""

    model: ModelSpec
    """The model whose architecture (and initial weights) the engine loads."""
    kind: str = "hf"
    """An `dppo.rollout.ENGINES` name: hf, vllm or vllm-server."""
    dtype: str = "float32"
    """float32, bfloat16 or float16: the dtype the engine samples in."""
    device: str = "cpu"
    """Where the engine runs (cpu, cuda, cuda:N)."""
    seed: int = 0
    """Seed of the engine's sampling generator."""
    top_k_logprobs: int = 0
    """K: µ's top-K the engine must be able to record (checked against its cap at build time)."""
    quantization: str = "none"
    """none or fp8 (`dppo.rollout.quantize.QuantizedEngine`)."""
    fp8_activations: bool = False
    """With fp8 and the hf engine: also quantise the decoder linear layers' inputs."""
    hf_max_batch_rows: int = 0
    """hf: most responses decoded together (0 = all)."""
    vllm: dict = field(default_factory=dict)
    """vLLM engine keywords (kv_cache_gb on CPU, gpu_memory_utilization on CUDA; vllm-server: its servers, URLs,
    partial mode, timeouts, logs and weights folder)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")


def build_engine(spec: EngineSpec):
    """The engine of `spec`, with the initial weights of `spec.model` (ValueError naming the field for a K above
    the engine's cap)."""
    dtype = DTYPES[spec.dtype]
    if spec.kind == "hf":
        model, tokenizer, _ = load(spec.model, dtype=dtype)
        engine = make_engine("hf", model=model.to(spec.device), tokenizer=tokenizer, dtype=dtype, seed=spec.seed,
                             copy=False, max_batch_rows=spec.hf_max_batch_rows or None)
    else:  # vLLM loads a folder; the tiny model (no folder) is handed over as a module, which it saves itself
        model, tokenizer, path = load(spec.model, dtype=torch.float32)
        where = {"device": spec.device} if spec.kind == "vllm-server" else {}  # the servers' device
        engine = make_engine(spec.kind, path if path is not None else model, tokenizer, dtype=spec.dtype,
                             seed=spec.seed, max_logprobs=max(DEFAULT_TOP_K, spec.top_k_logprobs), **where,
                             **spec.vllm)
        del model
    if spec.top_k_logprobs > engine.max_logprobs:
        engine.close()
        raise ValueError(f"rollout.top_k_logprobs: {spec.top_k_logprobs} exceeds the {spec.kind} engine's "
                         f"max_logprobs {engine.max_logprobs}")
    if spec.quantization == "fp8":
        engine = QuantizedEngine(engine, activations=spec.fp8_activations)
    return engine
