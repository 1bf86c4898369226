"""The command line's spellings of `rollout.engines`, parsed into the list in one place.

A run's engines are one list of typed nodes (`dppo.rollout.settings.EngineNode`: kind, dtype, fp8, lag and the kind's
own settings; one engine is a list of one). The command line keeps the flags users know, and `replace` takes the
same names:

    --rollout.engine hf --rollout.dtype bfloat16 [--rollout.quantization fp8] [--rollout.engine-lag 2]
                                                         one engine
    --rollout.fleet "vllm-server:bfloat16,hf:float32"    several, KIND:DTYPE[:fp8] each
    --rollout.hf.max-batch-rows 4                        a setting of every engine of that kind

`RolloutFlags` is the rollout section as the parser sees it (the fields of `RolloutCommon`, those five flags and one
node per engine kind), `to_flags` writes a config's engines as those flags (a list of several as a fleet, each kind's
node from its first engine), and `engines_of` reads the flags back into the list against the engines they started
from: flags the command line did not change keep the engines as they were (a config file's two vllm-server engines
with their own URLs stay two), a changed `--rollout.engine`/`dtype`/`quantization` gives one engine, a changed
`--rollout.fleet` its members, and a changed `--rollout.<kind>.<field>` applies to every engine of that kind (a
setting of a kind the run does not use is refused, naming the flag). The command line parses the run config with
this section (`dppo.cli.CliConfig`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dppo._checks import config_fail
from dppo.rollout.settings import ENGINE_DTYPES, ENGINES, EngineNode
from dppo.train.rollout_config import EngineKind, RolloutCommon, RolloutConfig

SCALARS = ("engine", "dtype", "quantization", "engine_lag", "fleet")
"""The flags that choose the engines (beside the per-kind nodes)."""
FLAG_FIELDS = frozenset((*SCALARS, *(s.node() for s in ENGINES.values())))
"""Every rollout field name that is a spelling of rollout.engines (`dppo.train.config.replace` routes them here)."""
VARIES = None
"""`engine_lag` of a list whose engines' lags differ (left as it is unless the command line gives one)."""


@dataclass(frozen=True)
class _EngineFlags(RolloutCommon):
    """The rollout section as the command line spells it: the engines as flags (`dppo.train.engine_flags`)."""

    engine: EngineKind = "auto"
    """One engine's kind: auto = the faster engine for the hardware and engine dtype
    (dppo.runtime.hardware.resolve_engine): vllm on CUDA and on CPUs in bf16; hf on CPUs in float32 (it shares each
    prompt's prefix across its G samples); vllm only when importable. vllm-server = vLLM's own server processes
    (started by dppo, or rollout.vllm_server.urls), weights through vLLM's weight-update API (docs/engines.md);
    never chosen by auto. Each kind's own settings are its node (rollout.hf, rollout.vllm, rollout.vllm_server). A
    config file lists its engines instead (rollout.engines)."""
    dtype: Literal[ENGINE_DTYPES] = "auto"
    """Dtype the engine samples in. auto = bfloat16 where it is native (CUDA with bf16; CPUs with avx512_bf16 or
    AMX), float32 otherwise (emulated bf16 is 3-4x slower). bf16 vs an fp32 trainer is a real mismatch; float16
    (never a default) narrows it at the source, with an fp16 trainer most of all."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8 = the engine samples from float8 e4m3 weights (one scale per output channel, quantised at every weight
    sync; dppo.rollout.quantize) and records that model's log-probs as µ: cheap inference and a mismatch that
    grows with the weights' scale."""
    engine_lag: int | None = 0
    """The engines sample with the weights of this many optimiser steps ago (a deterministic stand-in for stale
    rollouts; µ is still recorded by the engine, so the importance weight and the mask stay exact). None = the
    config's engines have lags of their own (rollout.engines[j].lag)."""
    fleet: str = ""
    """Several engines instead of one: comma-separated members KIND:DTYPE[:fp8] (e.g. "vllm-server:bfloat16,
    hf:float32" or "hf:bfloat16,hf:float32,hf:float32:fp8"), each with its kind's node (rollout.hf, ...): sync, they
    sample whole prompts in turn; async, rollout worker i holds engine i mod M. Every response is tagged with its
    engine j and the mismatch, masked share and reward are also logged per engine (`*_engine_{j}`); docs/engines.md.
    '' = one engine (rollout.engine)."""


RolloutFlags = dataclasses.make_dataclass(
    "RolloutConfig", [(s.node(), s, field(default_factory=s)) for s in ENGINES.values()], bases=(_EngineFlags,),
    frozen=True, namespace={"__doc__": RolloutConfig.__doc__, "__module__": __name__})
"""The `rollout` section the command line parses: `_EngineFlags` plus one node per engine kind."""


def _node_field(kind: str) -> str:
    return ENGINES[kind].node()


def member_text(node: EngineNode) -> str:
    """'hf:float32', 'hf:float32:fp8': the node as a `--rollout.fleet` member."""
    return f"{node.kind}:{node.dtype}" + (":fp8" if node.fp8 else "")


def parse_members(text: str) -> list[tuple[str, str, bool]]:
    """(kind, dtype, fp8) of each comma-separated "KIND:DTYPE[:fp8]" of `--rollout.fleet`; ConfigError naming
    rollout.fleet for a malformed member, an unknown kind or dtype."""
    members = []
    for item in text.split(","):
        parts = [p.strip() for p in item.strip().split(":")]
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "fp8"):
            config_fail("rollout.fleet", f"{item.strip()!r} is not KIND:DTYPE or KIND:DTYPE:fp8 "
                                         f"(e.g. hf:float32, vllm-server:bfloat16, hf:float32:fp8)")
        if parts[0] not in ENGINES and parts[0] != "auto":
            config_fail("rollout.fleet", f"unknown engine {parts[0]!r} in {item.strip()!r}; valid: {', '.join(ENGINES)}")
        if parts[1] not in ENGINE_DTYPES:
            config_fail("rollout.fleet", f"unknown dtype {parts[1]!r} in {item.strip()!r}; valid: "
                                         f"{', '.join(ENGINE_DTYPES)}")
        members.append((parts[0], parts[1], len(parts) == 3))
    return members


def to_flags(rollout: RolloutConfig) -> RolloutFlags:
    """The rollout section as flags: one engine as --rollout.engine/dtype/quantization/engine-lag and its node,
    several as --rollout.fleet (each kind's node from its first engine; engine_lag `VARIES` when their lags differ)."""
    common = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(RolloutCommon)}
    return RolloutFlags(**common, **_engine_flags(rollout.engines))


def _engine_flags(nodes: tuple[EngineNode, ...]) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for node in nodes:
        if node.settings is not None:
            kinds.setdefault(_node_field(node.kind), node.settings)
    if len(nodes) == 1:
        (n,) = nodes
        return {"engine": n.kind, "dtype": n.dtype, "quantization": "fp8" if n.fp8 else "none", "engine_lag": n.lag,
                **kinds}
    lags = {n.lag for n in nodes}
    return {"fleet": ",".join(map(member_text, nodes)), "engine_lag": lags.pop() if len(lags) == 1 else VARIES, **kinds}


def _changes(a, b) -> dict[str, Any]:
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def engines_of(flags: RolloutFlags, base: tuple[EngineNode, ...], given=()) -> tuple[EngineNode, ...]:
    """The engine list `flags` spell, read against the list `base` they were written from (`to_flags`; see the
    module docstring); `given`: the flags named explicitly (on the command line, or in `replace`), changed even when
    their value is the base's. ConfigError naming the flag for a setting of an engine kind the list does not hold,
    an engine/dtype/quantization other than auto/none beside a fleet, or a malformed fleet."""
    was = RolloutFlags(**_engine_flags(base))
    changed = {name for name in SCALARS if name in given or getattr(flags, name) != getattr(was, name)}
    edits = {s.kind: _changes(getattr(flags, s.node()), getattr(was, s.node())) for s in ENGINES.values()}
    lag = flags.engine_lag
    if "fleet" in changed and flags.fleet.strip():
        for name in ("engine", "dtype", "quantization"):
            if name in changed and getattr(flags, name) != getattr(RolloutFlags, name):
                config_fail("rollout.fleet", f"each member names its engine, dtype and fp8 (KIND:DTYPE[:fp8]): leave "
                                             f"rollout.{name} out (got {getattr(flags, name)!r})")
        nodes = [EngineNode(kind, dtype, fp8, lag or 0, _settings(flags, kind))
                 for kind, dtype, fp8 in parse_members(flags.fleet)]
    elif changed - {"engine_lag"} or len(base) <= 1:
        if flags.engine == "auto" and any(edits.values()):
            kind, edit = next((k, e) for k, e in edits.items() if e)
            config_fail(f"rollout.{ENGINES[kind].node()}.{next(iter(edit))}",
                        f"a setting of the {kind} engine, but rollout.engine is auto: name the engine "
                        f"(--rollout.engine {kind})")
        nodes = [EngineNode(flags.engine, flags.dtype, flags.quantization == "fp8", lag or 0,
                            _settings(flags, flags.engine))]
    else:  # the list as it was, each kind's changed settings applied to its engines
        nodes = [dataclasses.replace(n, lag=n.lag if lag is None or "engine_lag" not in changed else lag,
                                     settings=n.settings and dataclasses.replace(n.settings, **edits[n.kind]))
                 for n in base]
    used = {n.kind for n in nodes}
    for kind, edit in edits.items():
        if edit and kind not in used:
            config_fail(f"rollout.{ENGINES[kind].node()}.{next(iter(edit))}",
                        f"a setting of the {kind} engine, but the run's engines are "
                        f"{', '.join(repr(k) for k in sorted(used))} (rollout.engines)")
    return tuple(nodes)


def _settings(flags: RolloutFlags, kind: str):
    return getattr(flags, _node_field(kind)) if kind in ENGINES else None


def from_flags(flags: RolloutFlags, base: tuple[EngineNode, ...], given=()) -> RolloutConfig:
    """The rollout section of `flags` (its engines read against `base`, `engines_of`)."""
    common = {f.name: getattr(flags, f.name) for f in dataclasses.fields(RolloutCommon)}
    return RolloutConfig(**common, engines=engines_of(flags, base, given))


def with_flags(rollout: RolloutConfig, values: dict[str, Any]) -> RolloutConfig:
    """`rollout` with some flags given (`dppo.train.config.replace`'s rollout dict: a node as a dict of its fields)."""
    flags = to_flags(rollout)
    values = {k: dataclasses.replace(getattr(flags, k), **v) if isinstance(v, dict)
              and dataclasses.is_dataclass(getattr(flags, k)) else v for k, v in values.items()}
    return from_flags(dataclasses.replace(flags, **values), rollout.engines, given=set(values))


def given_flags(args: list[str]) -> set[str]:
    """The engine flags (`SCALARS`) named on command line `args` (`--rollout.engine hf`, `--rollout.engine=hf`)."""
    named = {a.split("=", 1)[0] for a in args}
    return {name for name in SCALARS if f"--rollout.{name.replace('_', '-')}" in named}
