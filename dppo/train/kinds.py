"""The run's component choices checked against the settings of every kind: the engine (rollout.engine, one node per
`dppo.rollout.settings.ENGINES` entry) and the episode kind (rollout.episodes, one config section per
`dppo.episodes.settings.EPISODE_KINDS` entry that has settings). The settings of a kind the run does not use are
refused naming the field and the kind that takes them, and what a chosen kind cannot do (declared on its settings
class) is refused naming the field; `choose` switches a config to another kind, from that kind's defaults.
Generic over the registries: adding an engine or an episode kind changes nothing here."""

from __future__ import annotations

import dataclasses
from typing import Any

from dppo._checks import config_fail
from dppo.episodes.settings import EPISODE_KINDS
from dppo.rollout.settings import ENGINES


def check_engine(rollout, *engines: str) -> None:
    """ConfigError naming the field for what each of `engines` (resolved kinds: the run's engine, or its fleet's
    kinds) cannot do, read from its settings class (in-flight updates; async rollouts need an engine that receives
    weights), and for a setting of another engine: each engine's settings live in its own node, and a node of an
    engine the run does not use keeps its defaults."""
    for engine in engines:
        settings = ENGINES[engine]
        if rollout.in_flight_updates and not settings.can_update_in_flight:
            can = ", ".join(k for k, s in ENGINES.items() if s.can_update_in_flight)
            config_fail("rollout.in_flight_updates", f"the {engine} engine cannot update in flight ({can} can)")
        if rollout.mode == "async" and not settings.can_receive_weights:
            config_fail("rollout.engine", f"{engine!r} cannot receive weights, which rollout.mode async needs after "
                                          f"every optimiser step")
    for kind, settings in ENGINES.items():
        node = getattr(rollout, settings.node())
        if kind in engines or node == settings():
            continue
        name = next(f.name for f in dataclasses.fields(node) if getattr(node, f.name) != getattr(settings(), f.name))
        used = f"rollout.fleet has no {kind} member" if rollout.fleet else \
            f"the run's engine is {engines[0]!r} (rollout.engine)"
        config_fail(f"rollout.{settings.node()}.{name}", f"a setting of the {kind} engine, but {used}")


def check_fleet(rollout) -> None:
    """ConfigError naming rollout.fleet for what a fleet cannot do (`dppo.rollout.fleet`): rollout.engine, dtype or
    quantization set beside it (each member names its own), async rollouts or in-flight updates, multi-turn
    episodes, two in-process vLLM engines, two vllm-server members on the same given servers; then `check_engine`
    over its members' kinds."""
    members = rollout.fleet_members
    for name, free in (("engine", "auto"), ("dtype", "auto"), ("quantization", "none")):
        if getattr(rollout, name) != free:
            config_fail("rollout.fleet", f"each member names its engine, dtype and fp8 (KIND:DTYPE[:fp8]): leave "
                                         f"rollout.{name} {free} (got {getattr(rollout, name)!r})")
    if rollout.mode != "sync" or rollout.in_flight_updates:
        config_fail("rollout.fleet", "needs rollout.mode sync without in-flight updates (a rollout worker holds one "
                                     "engine)")
    if rollout.episodes != "single":
        config_fail("rollout.fleet", f"needs rollout.episodes single, got {rollout.episodes!r} (an episode's turns are "
                                     f"separate engine calls: its turns and its group would go to different members)")
    if sum(m.kind == "vllm" for m in members) > 1:
        config_fail("rollout.fleet", "at most one in-process vllm member (vLLM's offline engines share this "
                                     "process's random state); use vllm-server members for more")
    if sum(m.kind == "vllm-server" for m in members) > 1 and rollout.vllm_server.urls:
        config_fail("rollout.fleet", "two vllm-server members would share the servers of rollout.vllm_server.urls; "
                                     "leave urls '' (each member starts its own) or use one vllm-server member")
    check_engine(rollout, *dict.fromkeys(m.kind for m in members))


def check_episodes(cfg) -> None:
    """ConfigError naming the field for a setting of an episode kind other than rollout.episodes (each kind's
    settings are the config section of its name, `dppo.episodes.settings.EPISODE_KINDS`, and a section of a kind the
    run does not use keeps its defaults), and for what the chosen kind's settings refuse beside the rollout
    (`check_run`: an environment or agent to run, a turn longer than the episode's token budget)."""
    chosen = cfg.rollout.episodes
    for kind, settings in EPISODE_KINDS.items():
        section = getattr(cfg, kind, None)
        if kind == chosen or section is None or section == settings():
            continue
        name = next(f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(settings(), f.name))
        config_fail(f"{kind}.{name}", f"a setting of the {kind} episodes, but the run's episodes are {chosen!r} "
                                      f"(rollout.episodes)")
    cfg.episode_settings.check_run(max_new_tokens=cfg.rollout.max_new_tokens)


def choose(cfg, *, engine: str | None = None, episodes: str | None = None, fleet: str | None = None):
    """`cfg` with another engine, fleet or episode kind chosen, the settings of the kinds no longer chosen back at
    their defaults (the command line's `--rollout.engine` / `--rollout.fleet` / `--rollout.episodes` over a preset or
    config of another kind start from here; a fleet also sets rollout.engine and rollout.dtype auto and
    rollout.quantization none, which its members name instead). A name that is no kind changes nothing (the command
    line's parser then names it)."""
    rollout: dict[str, Any] = {}
    if engine in ENGINES and engine != cfg.rollout.engine:
        rollout = {"engine": engine, **{s.node(): s() for k, s in ENGINES.items() if k != engine}}
    if fleet and fleet != cfg.rollout.fleet:
        kinds = {item.split(":")[0].strip() for item in fleet.split(",")}
        rollout = {"engine": "auto", "dtype": "auto", "quantization": "none",
                   **{s.node(): s() for k, s in ENGINES.items() if k not in kinds}}
    sections = {}
    if episodes in EPISODE_KINDS and episodes != cfg.rollout.episodes:
        rollout["episodes"] = episodes
        sections = {kind: settings() for kind, settings in EPISODE_KINDS.items()
                    if kind != episodes and hasattr(cfg, kind)}
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout), **sections)
