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


def check_engine(rollout, engine: str) -> None:
    """ConfigError naming the field for what `engine` (a resolved kind) cannot do, read from its settings class
    (in-flight updates; async rollouts need an engine that receives weights), and for a setting of another engine:
    each engine's settings live in its own node, and a node of an engine the run does not use keeps its defaults."""
    settings = ENGINES[engine]
    if rollout.in_flight_updates and not settings.can_update_in_flight:
        can = ", ".join(k for k, s in ENGINES.items() if s.can_update_in_flight)
        config_fail("rollout.in_flight_updates", f"the {engine} engine cannot update in flight ({can} can)")
    if rollout.mode == "async" and not settings.can_receive_weights:
        config_fail("rollout.engine", f"{engine!r} cannot receive weights, which rollout.mode async needs after "
                                      f"every optimiser step")
    for kind, settings in ENGINES.items():
        node = getattr(rollout, settings.node())
        if kind == engine or node == settings():
            continue
        name = next(f.name for f in dataclasses.fields(node) if getattr(node, f.name) != getattr(settings(), f.name))
        config_fail(f"rollout.{settings.node()}.{name}", f"a setting of the {kind} engine, but the run's engine "
                                                         f"is {engine!r} (rollout.engine)")


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


def choose(cfg, *, engine: str | None = None, episodes: str | None = None):
    """`cfg` with another engine or episode kind chosen, the settings of the kinds no longer chosen back at their
    defaults (the command line's `--rollout.engine` / `--rollout.episodes` over a preset or config of another kind
    start from here). A name that is no kind changes nothing (the command line's parser then names it)."""
    rollout: dict[str, Any] = {}
    if engine in ENGINES and engine != cfg.rollout.engine:
        rollout = {"engine": engine, **{s.node(): s() for k, s in ENGINES.items() if k != engine}}
    sections = {}
    if episodes in EPISODE_KINDS and episodes != cfg.rollout.episodes:
        rollout["episodes"] = episodes
        sections = {kind: settings() for kind, settings in EPISODE_KINDS.items()
                    if kind != episodes and hasattr(cfg, kind)}
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout), **sections)
