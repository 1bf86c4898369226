"""The engine kinds: one frozen settings class per rollout engine, and the `ENGINES` registry of them.

Each class is at once the engine's config node (`rollout.hf`, `rollout.vllm`, `rollout.vllm_server` in a run's
config; `--rollout.vllm-server.urls ...` on the command line) and what the engine, a rollout worker or a server
receives inside its `dppo.rollout.spec.EngineSpec`: no second spec restates or renames its fields. What an engine
can do is declared on its class (`can_receive_weights`, `can_update_in_flight`, `can_record_top_k`,
`quantizes_activations()`), never in a
list elsewhere; the engine itself lives in the module its `engine` names (imported only when built, so `vllm` is
imported only when a vLLM engine is asked for).

Adding an engine: write its class ("module:Class" with a `from_spec(spec)` constructor and the `dppo.rollout.base.Engine`
methods), add its settings class here with its capabilities, and one `ENGINES` entry; the config gets its node,
its flags and the refusal of its fields under another engine from the registry (`dppo.train.config`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from dppo._checks import config_fail as _fail


@dataclass(frozen=True)
class EngineSettings:
    """What every engine kind declares: its registry name, its class and its capabilities (class attributes, not
    fields: they are facts about the engine, not settings)."""

    kind: ClassVar[str]
    """The `ENGINES` name (rollout.engine)."""
    engine: ClassVar[str]
    """"module:Class" of the engine (imported lazily, `dppo.rollout.engine_class`); the class builds itself from an
    `EngineSpec` (`from_spec`)."""
    can_receive_weights: ClassVar[bool] = True
    """It loads the trainer's weights after every optimiser step (`load_weights`; rollout.mode async needs it)."""
    can_update_in_flight: ClassVar[bool] = False
    """A response being sampled can go on under newer weights (rollout.in_flight_updates)."""
    can_record_top_k: ClassVar[bool] = True
    """It records µ's top-K log-probs (the Top-K trust regions need them)."""

    exclusive: ClassVar[str] = ""
    """Why a run's engine list can hold at most one engine of this kind ('' = it can hold several)."""

    def quantizes_activations(self) -> bool:
        """With fp8 weights (`EngineNode.fp8`): whether the engine also quantises its decoder's linear-layer inputs
        (only an engine whose model runs in this process can; False for the others)."""
        return False

    def takes_adapter(self) -> bool:
        """Whether the engine takes the LoRA adapter at every sync instead of merged weights."""
        return False

    def check_node(self, node: "EngineNode", *, lora_rank: int, engines: tuple = ()) -> None:
        """ConfigError naming the field for what this kind refuses of its engine `node` in a run (its fp8, the run's
        LoRA rank, the run's other `engines`); nothing for most kinds."""

    def shared_with(self, other: "EngineSettings") -> str:
        """What two engines of this kind in one run would share that they cannot ('' = nothing)."""
        return ""

    @classmethod
    def node(cls) -> str:
        """The config node holding these settings: rollout.<node> (the kind with '-' as '_')."""
        return cls.kind.replace("-", "_")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                _fail(f"rollout.{self.node()}.{f.name}", f"expected >= 0, got {value}")


@dataclass(frozen=True)
class HFSettings(EngineSettings):
    """The hf engine: transformers in this process (or a rollout worker's), sharing each prompt's prefix across its
    G samples (`dppo.rollout.hf`)."""

    kind: ClassVar[str] = "hf"
    engine: ClassVar[str] = "dppo.rollout.hf:HFEngine"
    can_update_in_flight: ClassVar[bool] = True

    max_batch_rows: int = 0
    """Most responses decoded together (whole prompts per batch; bounds the KV cache); 0 = all P·G."""
    fp8_activations: bool = False
    """With fp8 weights (rollout.quantization fp8): also quantise every decoder linear layer's input per token (an hf
    engine without fp8 weights ignores it)."""

    def quantizes_activations(self) -> bool:
        return self.fp8_activations  # (only an engine with fp8 weights is asked: `dppo.rollout.spec.build_engine`)

    def check_node(self, node: "EngineNode", *, lora_rank: int, engines: tuple = ()) -> None:
        if self.fp8_activations and not any(n.fp8 for n in engines or (node,) if n.kind == self.kind):
            _fail("rollout.hf.fp8_activations", "needs an hf engine with fp8 weights (rollout.quantization fp8, or "
                                                "KIND:DTYPE:fp8 in rollout.fleet; fp8: true in rollout.engines); an "
                                                "hf engine without them ignores it")


@dataclass(frozen=True)
class VLLMSettings(EngineSettings):
    """The vllm engine: vLLM's offline `LLM` in this process (or a rollout worker's), weights loaded in place
    (`dppo.rollout.vllm`)."""

    kind: ClassVar[str] = "vllm"
    engine: ClassVar[str] = "dppo.rollout.vllm:VLLMEngine"
    exclusive: ClassVar[str] = ("vLLM's offline engines share this process's random state; use vllm-server engines "
                                "for more")

    kv_cache_gb: float = 2.0
    """On CPU: the KV cache size in GB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """On GPU: the fraction of GPU memory for the engine (it shares the GPU with the trainer)."""

    def __post_init__(self) -> None:
        if not self.kv_cache_gb > 0:
            _fail("rollout.vllm.kv_cache_gb", f"expected > 0, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            _fail("rollout.vllm.gpu_memory_utilization", f"expected in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class VLLMServerSettings(EngineSettings):
    """The vllm-server engine: vLLM's own server processes, started by dppo or given as `urls`, weights through
    vLLM's weight-update API (`dppo.rollout.server`, docs/engines.md). Never chosen by rollout.engine auto."""

    kind: ClassVar[str] = "vllm-server"
    engine: ClassVar[str] = "dppo.rollout.server.engine:ServerEngine"
    can_update_in_flight: ClassVar[bool] = True

    servers: int = 1
    """Servers dppo starts per engine (seeds train.seed, +1, ...; requests go to the one with the fewest
    outstanding)."""
    urls: str = ""
    """Comma-separated URLs of running servers to use instead of starting any (started with
    `python -m dppo.rollout.server.serve`, docs/engines.md)."""
    partial: Literal["keep", "abort"] = "keep"
    """With in-flight updates: keep = requests in flight are frozen (vLLM's /pause?mode=keep) and go on under the new
    weights; abort = they are aborted and sent again as prompt + tokens so far."""
    timeout_s: float = 600.0
    """The longest one generate request may take (then its server counts as failed: restarts); a server's start may
    take as long."""
    restarts: int = 3
    """A server dppo started that dies (or hangs past timeout_s) is restarted in the background with the current
    weights, up to this many times per server in the run, while its requests go to the other servers (or wait for
    it); 0 = a dead server is left out, and the step fails when none is left (--resume continues). Attached servers
    (urls) that die are left out until they answer /health again."""
    args: str = ""
    """More `vllm serve` flags for the servers dppo starts (shell syntax)."""
    weights_dir: str = ""
    """Where weight files are written for the servers ('' = /dev/shm); a folder the servers can read."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With model.lora_rank > 0: merged = the servers get the full weights, LoRA merged, at every sync; adapter =
    only the adapter, loaded by each server as a new LoRA adapter per version (no merge; a request finishes under
    the adapter it started with)."""
    kv_cache_gb: float = 2.0
    """On CPU: each server's KV cache size in GB."""

    def __post_init__(self) -> None:
        if self.servers < 1:
            _fail("rollout.vllm_server.servers", f"expected >= 1, got {self.servers}")
        if self.restarts < 0:
            _fail("rollout.vllm_server.restarts", f"expected >= 0, got {self.restarts}")
        if self.urls and self.servers != 1:
            _fail("rollout.vllm_server.servers", "dppo starts servers only without rollout.vllm_server.urls "
                                                 "(one engine per URL list)")
        for url in self.url_list:
            if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", url):
                _fail("rollout.vllm_server.urls", f"{url!r} is not a server URL (expected http://host:port)")
        for name, valid in (("partial", ("keep", "abort")), ("lora_sync", ("merged", "adapter"))):
            if getattr(self, name) not in valid:
                _fail(f"rollout.vllm_server.{name}", f"expected one of {', '.join(valid)}, got {getattr(self, name)!r}")
        for name in ("timeout_s", "kv_cache_gb"):
            if not getattr(self, name) > 0:
                _fail(f"rollout.vllm_server.{name}", f"expected > 0, got {getattr(self, name)}")
        try:
            shlex.split(self.args)
        except ValueError as exc:
            _fail("rollout.vllm_server.args", f"not shell syntax ({exc})")

    def takes_adapter(self) -> bool:
        return self.lora_sync == "adapter"

    def check_node(self, node: "EngineNode", *, lora_rank: int, engines: tuple = ()) -> None:
        if self.lora_sync == "adapter" and not lora_rank:
            _fail("rollout.vllm_server.lora_sync", "'adapter' needs a LoRA run (model.lora_rank > 0)")
        if self.lora_sync == "adapter" and node.fp8:
            _fail("rollout.vllm_server.lora_sync", "'adapter' sends no base weights to quantise; use fp8 false "
                                                   "(rollout.quantization none)")

    def shared_with(self, other: EngineSettings) -> str:
        both = set(self.url_list) & set(getattr(other, "url_list", ()))
        return f"the server {sorted(both)[0]} (rollout.vllm_server.urls: give each engine its own)" if both else ""

    @property
    def url_list(self) -> list[str]:
        return [u.strip() for u in self.urls.split(",") if u.strip()]

    @property
    def arg_list(self) -> tuple[str, ...]:
        return tuple(shlex.split(self.args))


@dataclass(frozen=True)
class Adapter:
    """The run's LoRA adapter shape (model.lora_*), for an engine that takes adapters instead of merged weights
    (vllm-server with lora_sync adapter)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


ENGINES: dict[str, type[EngineSettings]] = {s.kind: s for s in (HFSettings, VLLMSettings, VLLMServerSettings)}
"""Engine kind -> its settings class (which names the engine class and declares what it can do)."""

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""An engine's dtype: auto (`dppo.runtime.hardware.resolve_dtype`) or a name in `dppo.runtime.models.DTYPES`."""


@dataclass(frozen=True)
class EngineNode:
    """One engine of the run's list (`rollout.engines`): its kind, the dtype it samples in, fp8 weights or not, how
    many optimiser steps behind it samples, and its kind's own settings. One engine is a list of one; with several,
    engine j samples whole prompts in turn (sync, `dppo.rollout.fleet`) or serves rollout worker i with i mod M = j
    (async), and its responses are tagged j (metrics `*_engine_{j}`).

    In a config file an engine is one mapping, its kind's settings beside the four common fields:
    `{kind: vllm-server, dtype: bfloat16, fp8: false, lag: 0, urls: "http://a:8000"}`. On the command line the
    spellings `--rollout.engine/--rollout.dtype/--rollout.quantization/--rollout.engine-lag`, `--rollout.fleet` and
    `--rollout.<kind>.<field>` parse into the list (`dppo.train.engine_flags`)."""

    kind: str = "auto"
    """A name in `ENGINES`, or auto (resolved by the hardware once: `dppo.runtime.hardware.resolve_engine`)."""
    dtype: str = "auto"
    """The dtype it samples in (`ENGINE_DTYPES`; auto = bf16 where native, float32 otherwise)."""
    fp8: bool = False
    """It samples from float8 e4m3 weights (`dppo.rollout.quantize`), quantised at every weight sync."""
    lag: int = 0
    """It samples with the weights of this many optimiser steps ago (a deterministic stand-in for a slow or stale
    engine: µ is still what it sampled from, so the importance weight and the mask stay exact)."""
    settings: EngineSettings | None = None
    """Its kind's settings (None = that kind's defaults; always None while kind is auto)."""

    def __post_init__(self) -> None:
        if self.kind != "auto" and self.kind not in ENGINES:
            _fail("rollout.engine", f"unknown engine {self.kind!r}; valid: auto, {', '.join(ENGINES)}")
        if self.dtype not in ENGINE_DTYPES:
            _fail("rollout.dtype", f"unknown dtype {self.dtype!r}; valid: {', '.join(ENGINE_DTYPES)}")
        if self.lag < 0:
            _fail("rollout.engine_lag", f"expected >= 0, got {self.lag}")
        if self.kind == "auto":
            if self.settings is not None:
                _fail(f"rollout.{self.settings.node()}", f"a setting of the {self.settings.kind} engine, but the "
                                                         f"engine is auto: name it (rollout.engine {self.settings.kind})")
            return
        if self.settings is None:
            object.__setattr__(self, "settings", ENGINES[self.kind]())
        elif type(self.settings) is not ENGINES[self.kind]:
            _fail(f"rollout.{self.settings.node()}", f"a setting of the {self.settings.kind} engine given to a "
                                                     f"{self.kind} engine")

    @property
    def resolved(self) -> bool:
        """Whether its kind is decided (not auto): what it can do is then known."""
        return self.kind != "auto"

    def describe(self) -> str:
        """'hf float32', 'hf bfloat16 fp8 lag 2': how the run announces it."""
        return " ".join([self.kind, self.dtype] + ["fp8"] * self.fp8 + [f"lag {self.lag}"] * bool(self.lag))

    def to_dict(self) -> dict:
        """The node as a config file holds it: the four common fields, then its kind's settings."""
        common = {"kind": self.kind, "dtype": self.dtype, "fp8": self.fp8, "lag": self.lag}
        return {**common, **({} if self.settings is None else
                             {f.name: getattr(self.settings, f.name) for f in fields(self.settings)})}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "EngineNode":
        """The node of one config-file mapping (`to_dict`); ConfigError naming `where` (rollout.engines[j]) and the
        field for an unknown field."""
        if not isinstance(data, dict):
            _fail(where, f"expected a mapping {{kind: ..., dtype: ..., ...}}, got {data!r}")
        data = dict(data)
        common = {k: data.pop(k) for k in ("kind", "dtype", "fp8", "lag") if k in data}
        kind = common.get("kind", "auto")
        settings_cls = ENGINES.get(kind)
        known = {f.name for f in fields(settings_cls)} if settings_cls else set()
        for key in data:
            if key not in known:
                _fail(f"{where}.{key}", f"unknown field of a {kind} engine; valid: kind, dtype, fp8, lag"
                                        + "".join(f", {k}" for k in sorted(known)))
        if isinstance(data.get("urls"), list):
            data["urls"] = ",".join(data["urls"])
        return cls(**common, settings=settings_cls(**data) if settings_cls else None)
