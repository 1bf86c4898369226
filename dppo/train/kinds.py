"""The run's component choices checked against the settings of every kind: the engines (rollout.engines, each node of
a kind in `dppo.rollout.settings.ENGINES`) and the episode kind (rollout.episodes, one config section per
`dppo.episodes.settings.EPISODE_KINDS` entry that has settings; the `proxy` section for the kinds whose settings class
declares `uses_proxy`). What a chosen kind cannot do (declared on its settings class) is refused naming the field, and
the settings of an episode kind the run does not use (or the proxy's, when its kind plays through none) are refused
naming the field and the kind that takes them; `choose` switches a config to another episode kind, from that kind's
defaults. Generic over the registries: adding an engine or an episode kind changes nothing here."""

from __future__ import annotations

import dataclasses
from dppo._checks import config_fail
from dppo.episodes.settings import EPISODE_KINDS, ProxySettings
from dppo.rollout.settings import ENGINES


def check_engines(rollout) -> None:
    """ConfigError naming the field for what the rollout's engines (`rollout.engines`, resolved kinds; an engine
    still auto is checked once resolved) cannot do, read from each kind's settings class: update in flight, receive
    weights (async rollouts need it after every optimiser step), two engines of a kind that allows one (`exclusive`)
    or two that would share what they cannot (`shared_with`: the same server); fp8 weights beside in-flight updates;
    several engines in one process (sync) with multi-turn episodes (an episode's turns are separate engine calls,
    which `dppo.rollout.fleet` would deal to different engines); fewer async workers than engines."""
    nodes = [(j, n) for j, n in enumerate(rollout.engines) if n.resolved]
    for j, node in nodes:
        settings = ENGINES[node.kind]
        if rollout.in_flight_updates and not settings.can_update_in_flight:
            can = ", ".join(k for k, s in ENGINES.items() if s.can_update_in_flight)
            config_fail("rollout.in_flight_updates", f"the {node.kind} engine cannot update in flight ({can} can)")
        if rollout.mode == "async" and not settings.can_receive_weights:
            config_fail("rollout.engine", f"{node.kind!r} cannot receive weights, which rollout.mode async needs after "
                                          f"every optimiser step")
        if settings.exclusive and sum(n.kind == node.kind for _, n in nodes) > 1:
            config_fail("rollout.engines", f"at most one {node.kind} engine: {settings.exclusive}")
        for i, other in nodes[:j]:
            shared = other.kind == node.kind and node.settings.shared_with(other.settings)
            if shared:
                config_fail(f"rollout.engines[{j}]", f"engines {i} and {j} would share {shared}")
    if rollout.in_flight_updates and any(n.fp8 for n in rollout.engines):
        config_fail("rollout.in_flight_updates", "needs engines without fp8 weights (rollout.quantization none)")
    many = len(rollout.engines) > 1
    if many and rollout.mode == "sync" and not EPISODE_KINDS[rollout.episodes].one_engine_call:
        config_fail("rollout.fleet", f"several engines in one process need rollout.episodes single, got "
                                     f"{rollout.episodes!r} (an episode's turns are separate engine calls: its turns "
                                     f"and its group would go to different engines); rollout.mode async gives each "
                                     f"worker one engine")
    if rollout.mode == "async" and 0 < len(rollout.device_list) < len(rollout.engines):
        config_fail("rollout.devices", f"{len(rollout.device_list)} rollout workers for {len(rollout.engines)} "
                                       f"engines: worker i holds engine i mod M, so every engine needs a worker")


def check_run_engines(rollout, *, top_k: int, lora_rank: int) -> None:
    """ConfigError naming the field for what the engines refuse beside the rest of the run: µ's top-K an engine
    cannot record, what a kind refuses of its engine (`EngineSettings.check_node`: e.g. fp8 activations without fp8
    weights, adapter sync without LoRA), engines that take the adapter beside engines that take merged weights, and
    more engines than prompts per step (sync: every engine samples whole prompts)."""
    for j, node in enumerate(rollout.engines):
        if not node.resolved:
            continue
        if top_k and not ENGINES[node.kind].can_record_top_k:
            config_fail("rollout.top_k_logprobs", f"the {node.kind} engine does not record µ's top-K log-probs "
                                                  f"(K = {top_k})")
        node.settings.check_node(node, lora_rank=lora_rank, engines=rollout.engines)
    adapters = {n.settings is not None and n.settings.takes_adapter() for n in rollout.engines}
    if len(adapters) > 1:
        config_fail("rollout.vllm_server.lora_sync", "'adapter' in one engine and merged weights in another: the "
                                                     "trainer sends one of the two to every engine")
    if rollout.mode == "sync" and len(rollout.engines) > rollout.prompts_per_step:
        config_fail("rollout.fleet", f"{len(rollout.engines)} engines but rollout.prompts_per_step = "
                                     f"{rollout.prompts_per_step}: every engine needs at least one prompt per step")


def check_episodes(cfg) -> None:
    """ConfigError naming the field for a setting of an episode kind other than rollout.episodes (each kind's
    settings are the config section of its name, `dppo.episodes.settings.EPISODE_KINDS`, and a section of a kind the
    run does not use keeps its defaults), for a setting of the recording proxy (the `proxy` section) when the chosen
    kind plays through none (its settings class's `uses_proxy`), and for what the chosen kind's settings and its
    proxy refuse beside the rollout (`check_run`: an environment or agent to run, a turn longer than the episode's
    token budget, a missing extra)."""
    chosen = cfg.rollout.episodes
    for kind, settings in EPISODE_KINDS.items():
        section = getattr(cfg, kind, None)
        if kind != chosen and section is not None:
            _refuse_changed(kind, section, settings(), f"a setting of the {kind} episodes, but the run's episodes "
                                                       f"are {chosen!r} (rollout.episodes)")
    own = cfg.episode_settings
    if not own.uses_proxy:
        users = " and ".join(k for k, s in EPISODE_KINDS.items() if s.uses_proxy)
        _refuse_changed("proxy", cfg.proxy, ProxySettings(), f"a setting of the recording proxy, which the run's "
                                                             f"episodes {chosen!r} (rollout.episodes) do not play "
                                                             f"through ({users} do)")
    own.check_run(max_new_tokens=cfg.rollout.max_new_tokens)
    if own.uses_proxy:
        cfg.proxy.check_run(max_new_tokens=cfg.rollout.max_new_tokens, kind=chosen)


def _refuse_changed(section: str, settings, defaults, why: str) -> None:
    """ConfigError naming the first field of `settings` (the config section `section`) off its default, and `why`."""
    changed = [f.name for f in dataclasses.fields(settings) if getattr(settings, f.name) != getattr(defaults, f.name)]
    if changed:
        config_fail(f"{section}.{changed[0]}", why)


def choose(cfg, *, episodes: str | None = None):
    """`cfg` with another episode kind chosen, the settings of the kinds no longer chosen back at their defaults (the
    command line's `--rollout.episodes` over a preset or config of another kind starts from here; an engine chosen on
    the command line starts from its kind's settings the same way, `dppo.train.engine_flags.engines_of`), and the
    proxy's settings back at theirs when the kind chosen plays through none (`uses_proxy`). A name that is no kind
    changes nothing (the command line's parser then names it)."""
    if episodes not in EPISODE_KINDS or episodes == cfg.rollout.episodes:
        return cfg
    sections = {kind: settings() for kind, settings in EPISODE_KINDS.items() if kind != episodes and hasattr(cfg, kind)}
    if not EPISODE_KINDS[episodes].uses_proxy and hasattr(cfg, "proxy"):
        sections["proxy"] = ProxySettings()
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, episodes=episodes), **sections)
