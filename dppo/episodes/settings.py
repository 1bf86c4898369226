"""The episode kinds' settings: one frozen class per kind, at once its config node and what its driver receives.

    EPISODE_KINDS = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings}

`EnvSettings` is the run config's `env` section and `AgentSettings` its `agent` section (`dppo.train.config` imports
them; every default and every check lives here, once, each failure naming `env.<field>` / `agent.<field>`). The
single answer has no settings. Each class gives the trainer what it needs, the same way for every kind:

- `max_turns`: the turns of an episode, the bound of the loss's per-turn units (env.max_turns; an agent's calls,
  agent.max_calls; 1 for a single answer);
- `episodes(max_new_tokens=..., max_tokens=..., reward=...)`: the run's episodes (`dppo.rollout.source.Episodes`,
  picklable: rollout workers receive them) from these settings and the run-time values the kind needs;
- `scored_by_task`: whether the task's reward scores the episodes (else the environment or the agent does);
- `torchrun_refusal`: why the kind cannot run under torchrun ('' when it can).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from dppo._checks import ConfigError
from dppo.episodes.agent_loop import AgentEpisodes
from dppo.episodes.env_loop import EnvEpisodes
from dppo.episodes.single import SingleAnswer


def _fail(field_name: str, message: str) -> None:
    raise ConfigError(f"{field_name}: {message}")


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            _fail(f"{section}.{name}", f"expected > 0, got {value!r}")


def _json_object(name: str, text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ConfigError naming the field otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        _fail(name, f"expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class SingleSettings:
    """A single answer per prompt, a one-turn episode scored by the task's reward (`dppo.episodes.single`)."""

    scored_by_task: ClassVar[bool] = True
    torchrun_refusal: ClassVar[str] = ""

    @property
    def max_turns(self) -> int:
        return 1

    def episodes(self, *, max_new_tokens: int, max_tokens: int, reward=None) -> SingleAnswer:
        """The answers (of up to `max_new_tokens` tokens, rollout.max_new_tokens), scored by `reward` (the task's
        `RewardRunner`; None: episodes that only collect). `max_tokens` is not used."""
        return SingleAnswer(max_new_tokens, reward=reward)


@dataclass(frozen=True)
class EnvSettings:
    """Multi-turn episodes (docs/agents.md): an environment answers each assistant turn; '' = single-turn responses
    (each a one-turn episode scored by the task's reward). The episode limits' defaults live here only, checked here
    once (`dppo.episodes.env_loop` runs the episodes with these settings)."""

    name: str = ""
    """An environment (calculator, python, feedback) or `module:Class` / `path/to/file.py:Class`; '' = off."""
    options: str = "{}"
    """JSON object of the environment's options, e.g. '{"max_tool_chars": 500}'."""
    max_turns: int = 4
    """Assistant turns per episode (each turn's length is capped by rollout.max_new_tokens)."""
    max_tokens: int = 256
    """Response tokens of a whole episode, generated and environment tokens together; past it: truncated."""
    timeout_s: float = 30.0
    """Longest an environment's reset or step may take; past a step's, the episode ends and is counted as an env
    timeout."""

    scored_by_task: ClassVar[bool] = False
    torchrun_refusal: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _json_object("env.options", self.options)
        if self.max_turns < 1:
            _fail("env.max_turns", f"expected >= 1, got {self.max_turns}")
        if self.max_tokens < 1:
            _fail("env.max_tokens", f"expected >= 1, got {self.max_tokens}")
        _positive("env", timeout_s=self.timeout_s)

    @property
    def options_dict(self) -> dict[str, Any]:
        return json.loads(self.options)

    def episodes(self, *, max_new_tokens: int, max_tokens: int, reward=None) -> EnvEpisodes:
        """The environment's episodes: these settings are all they need (the environment scores each episode)."""
        return EnvEpisodes(self)


@dataclass(frozen=True)
class AgentSettings:
    """An agent written against an OpenAI client, trained through dppo's recording proxy (docs/agents.md, "Bring
    your own agent"): `agent(client, example) -> reward`; each call's tokens, µ and µ's top-K are recorded and joined
    into rows (a row's response tokens are capped by env.max_tokens, each call by rollout.max_new_tokens)."""

    name: str = ""
    """The agent function, `module:function` or `path/to/file.py:function` (sync: gets an openai.OpenAI; async:
    an openai.AsyncOpenAI); '' = off."""
    max_calls: int = 16
    """Calls per episode; past it a call is refused (the agent sees an OpenAI error)."""
    timeout_s: float = 120.0
    """Longest an episode may run (its agent, all its calls); past it the episode ends with reward 0, counted."""
    concurrency: int = 0
    """Episodes running at once (0 = all of the step's prompts_per_step x group_size)."""
    host: str = "127.0.0.1"
    """Where the proxy listens. Anything but a loopback address exposes it: then every request needs the run's
    key (`Authorization: Bearer`, passed as the client's api_key)."""
    port: int = 0
    """The proxy's port (0 = a free one)."""
    max_request_bytes: int = 1 << 20
    """Largest request body the proxy reads (413 past it)."""
    max_concurrent_requests: int = 256
    """Requests in flight at once (429 past it)."""

    scored_by_task: ClassVar[bool] = False
    torchrun_refusal: ClassVar[str] = (
        "agent.name: agents under torchrun are not supported (their episodes' rows differ in number between ranks); "
        "run one process, with async rollout workers if needed")

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            _fail("agent.max_calls", f"expected >= 1, got {self.max_calls}")
        if self.concurrency < 0:
            _fail("agent.concurrency", f"expected >= 0, got {self.concurrency}")
        if not 0 <= self.port <= 65535:
            _fail("agent.port", f"expected 0..65535, got {self.port}")
        _positive("agent", timeout_s=self.timeout_s, max_request_bytes=self.max_request_bytes,
                  max_concurrent_requests=self.max_concurrent_requests)
        if self.name and ":" not in self.name:
            _fail("agent.name", f"expected 'module:function' or 'path/to/file.py:function', got {self.name!r}")

    @property
    def max_turns(self) -> int:
        """An agent's turns are its calls: each generated token's turn is the call that sampled it."""
        return self.max_calls

    def episodes(self, *, max_new_tokens: int, max_tokens: int, reward=None) -> AgentEpisodes:
        """The agent's episodes, each of its rows holding up to `max_tokens` response tokens (env.max_tokens; each
        call's tokens are capped by the sampling parameters' max_new_tokens). The agent scores each episode."""
        return AgentEpisodes(self, max_tokens)


EPISODE_KINDS: dict[str, type] = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings}
"""Episode kind -> its settings class (the run config's section of the same name holds an instance; the single
answer has none)."""


__all__ = ["AgentSettings", "EPISODE_KINDS", "EnvSettings", "SingleSettings"]
