"""The run config's `rollout` section: the fields of the rollout beside its engines (`RolloutCommon`) and
`RolloutConfig`, those plus the engine list (`rollout.engines`, `dppo.rollout.settings.EngineNode`; one engine is a
list of one). Every default lives here, once; each check fails naming the field (what the engines cannot do:
`dppo.train.kinds.check_engines`). The command line's spellings of the list: `dppo.train.engine_flags`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dppo._checks import config_fail as _fail
from dppo._checks import config_positive as _positive
from dppo.episodes.settings import EPISODE_KINDS
from dppo.rollout.settings import ENGINES, EngineNode
from dppo.train.kinds import check_engines


EngineKind = Literal[("auto", *ENGINES)]
"""An engine's kind: auto or a name in `dppo.rollout.settings.ENGINES`."""
EpisodeKind = Literal[tuple(EPISODE_KINDS)]
"""rollout.episodes: a name in `dppo.episodes.settings.EPISODE_KINDS`."""


@dataclass(frozen=True)
class RolloutCommon:
    """The rollout's fields beside its engines: what is sampled (P prompts, G responses each, temperature, length,
    µ's top-K), the episode kind and where the engines run (sync, or async rollout workers)."""

    episodes: EpisodeKind = "single"
    """What one rollout is: single = one answer per prompt, scored by the task's reward; env = multi-turn episodes
    with the environment of the `env` section (env.name); agent = an agent's episodes through dppo's recording proxy
    (the `agent` section); verifiers = a verifiers v1 taskset's tasks played by verifiers' harness and client through
    the proxy (the `verifiers` section; its tasks are the run's examples); the proxy's own settings are the `proxy`
    section. The settings of a kind the run does not use are refused (docs/agents.md)."""
    prompts_per_step: int = 8
    """P: prompts sampled per training step."""
    group_size: int = 8
    """G: responses per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same temperature)."""
    max_new_tokens: int = 24
    """Maximum response length."""
    top_k_logprobs: int | None = None
    """K: record µ's top-K log-probs per token (0 = off). None = 20 when the trust region needs them (Top-K
    TV/KL), else the episode kind's default: 1 for rollout.episodes agent (clients ask µ's top-1 by default: SkyRL,
    verifiers' TrainClient), 0 otherwise."""
    mode: Literal["sync", "async"] = "sync"
    """sync = generate, train, sync weights, in turn, with the engines in the trainer's process. async = rollout
    workers in their own processes (one per `devices` entry; worker i holds engine i mod M of rollout.engines) sample
    the next batches while the trainer trains (dppo.rollout.remote; docs/async.md); each response records the weight
    version it was sampled under."""
    max_staleness: int = 1
    """async: a batch is trained at most this many optimiser steps after the weights that sampled it (0 = the
    same weights and metrics as sync, with the engine in another process), plus its engine's lag."""
    devices: str = ""
    """async: one rollout worker per comma-separated entry (cpu, cuda, cuda:N; 'cpu,cpu' = two CPU workers).
    '' = one worker per engine of rollout.engines on the trainer's device type."""
    backend: Literal["local", "ray"] = "local"
    """async: local = worker processes on this machine, weights published through shared memory; ray = Ray actors
    (placeable on other nodes of a Ray cluster), weights published through Ray's object store."""
    ray_address: str = ""
    """backend ray: the cluster to join ('auto', 'host:port'); '' = start a Ray instance on this machine."""
    worker_threads: int = 0
    """async: CPU threads of each CPU worker; 0 = the cores divided between the trainer and the CPU workers."""
    in_flight_updates: bool = False
    """async, local backend, an engine that can (hf, vllm-server): a worker also loads newer weights between decode
    chunks (every 8 tokens) of a response, recomputing its KV cache, so a response can span versions (each token
    records its own)."""
    worker_timeout_s: float = 600.0
    """async: a worker that returns nothing for this long (starting included) is reported as hung, by index."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                _fail(f"rollout.{name}", f"expected >= 1, got {getattr(self, name)}")
        _positive("rollout", temperature=self.temperature)
        if self.max_staleness < 0:
            _fail("rollout.max_staleness", f"expected >= 0, got {self.max_staleness}")
        if self.worker_threads < 0:
            _fail("rollout.worker_threads", f"expected >= 0, got {self.worker_threads}")
        _positive("rollout", worker_timeout_s=self.worker_timeout_s)
        if self.in_flight_updates and self.backend != "local":
            _fail("rollout.in_flight_updates", "needs rollout.backend local")
        for name in ("devices", "backend", "ray_address", "in_flight_updates"):
            if self.mode == "sync" and getattr(self, name) != getattr(RolloutCommon, name):
                _fail(f"rollout.{name}", "needs rollout.mode async")
        for device in self.device_list:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
                _fail("rollout.devices", f"{device!r} is not a device (expected cpu, cuda or cuda:N, comma-separated)")
        if self.top_k_logprobs is not None and self.top_k_logprobs < 0:
            _fail("rollout.top_k_logprobs", f"expected >= 0, got {self.top_k_logprobs}")

    @property
    def device_list(self) -> list[str]:
        """The rollout workers' devices (async), one entry per worker; [] = one worker per engine on the trainer's
        device."""
        return [d.strip() for d in self.devices.split(",")] if self.devices.strip() else []


@dataclass(frozen=True)
class RolloutConfig(RolloutCommon):
    """The rollout: what is sampled, by which engines (rollout.engines: a list of `EngineNode`s, each its kind, dtype,
    fp8, lag and its kind's own settings; one engine is a list of one), the episode kind, and where the engines run.
    The command line's `--rollout.engine/dtype/quantization/engine-lag`, `--rollout.fleet` and
    `--rollout.<kind>.<field>` are spellings of the list (`dppo.train.engine_flags`)."""

    engines: tuple[EngineNode, ...] = (EngineNode(),)
    """The engines that sample the run's responses, in order (engine j's responses are tagged j; with several, each
    metric of the mismatch, the masked share and the reward is also logged per engine, `*_engine_{j}`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "engines", tuple(self.engines))
        check_engines(self)

    @property
    def engine_kinds(self) -> tuple[str, ...]:
        """The engine kinds the run uses, in order, once each ('auto' while an engine's kind is unresolved)."""
        return tuple(dict.fromkeys(n.kind for n in self.engines))

    @property
    def max_lag(self) -> int:
        """The largest lag of the run's engines (the staleness it adds)."""
        return max(n.lag for n in self.engines)

    @property
    def takes_adapter(self) -> bool:
        """Whether the engines take the LoRA adapter at every sync instead of merged weights (all or none do)."""
        return any(n.settings is not None and n.settings.takes_adapter() for n in self.engines)
