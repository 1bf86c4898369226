"""Engines built from a spec: `EngineSpec` says everything an engine needs (model, its kind's settings, dtype,
device, seed, K, quantisation), frozen and picklable, and `build_engine(spec)` is the one factory.

The trainer's process and a rollout worker in another process build their engines the same way, from the same
spec (`dppo.train.rollout_build.engine_spec` makes it from the run config), so an engine never sees the run config. The
engine's own settings are its kind's settings class (`dppo.rollout.settings`), carried as they are in
`spec.settings`; the engine class builds itself from the spec (`from_spec`), so there is one dispatch: the kind's
registry entry. The engine is built with the architecture and initial weights of `spec.model`; its owner (a
`RolloutSource`) then loads the trainer's weights into it before the first generation. K (`top_k_logprobs`) is
checked against the engine's cap here, once, at build time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dppo.rollout import engine_class
from dppo.rollout.quantize import QuantizedEngine
from dppo.rollout.settings import Adapter, EngineSettings, HFSettings
from dppo.runtime.models import DTYPES, ModelSpec


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine, resolved (no `auto` left)."""

    model: ModelSpec
    """The model whose architecture (and initial weights) the engine loads."""
    settings: EngineSettings = field(default_factory=HFSettings)
    """The engine kind's own settings (`dppo.rollout.settings.ENGINES`): its class names the engine."""
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
    log_dir: str | None = None
    """Where an engine with processes of its own (vllm-server) writes their logs (None: a temporary folder)."""
    adapter: Adapter | None = None
    """The run's LoRA adapter (model.lora_rank > 0), for an engine set to take adapters."""
    versions_in_flight: int = 2
    """Most weight versions in use at once (the current one and those requests still use: max_staleness + 2 under
    async rollouts)."""
    lag: int = 0
    """It samples with the weights of this many optimiser steps ago (`EngineNode.lag`; its owner, an `EngineSource`
    or a rollout worker, holds the newer versions back)."""
    index: int = 0
    """Its place j in the run's engine list: its responses are tagged j (`Rollout.engine`)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def kind(self) -> str:
        """The engine's `ENGINES` name."""
        return self.settings.kind


def build_engine(spec: EngineSpec):
    """The engine of `spec`, with the initial weights of `spec.model` (ValueError naming the field for a K above
    the engine's cap)."""
    engine = engine_class(spec.kind).from_spec(spec)
    if spec.top_k_logprobs > engine.max_logprobs:
        engine.close()
        raise ValueError(f"rollout.top_k_logprobs: {spec.top_k_logprobs} exceeds the {spec.kind} engine's "
                         f"max_logprobs {engine.max_logprobs}")
    if spec.quantization == "fp8":
        engine = QuantizedEngine(engine, activations=spec.settings.quantizes_activations())
    return engine
