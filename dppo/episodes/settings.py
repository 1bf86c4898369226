"""The episode kinds' settings: one frozen class per kind, at once its config node and what its driver receives.

    EPISODE_KINDS = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings}

`EnvSettings` is the run config's `env` section and `AgentSettings` its `agent` section (`dppo.train.config` imports
them; every default and every check lives here, once, each failure naming `env.<field>` / `agent.<field>`). The
single answer has no settings. Each class gives the trainer what it needs, the same way for every kind:

- `max_turns`: the turns of an episode, the bound of the loss's per-turn units (env.max_turns; an agent's calls,
  agent.max_calls; 1 for a single answer);
- `episodes(max_new_tokens=..., reward=...)`: the run's episodes (`dppo.rollout.source.Episodes`, picklable:
  rollout workers receive them) from these settings and the run-time values the kind needs;
- `check_run(max_new_tokens=...)`: what the kind refuses once it is the run's choice (rollout.episodes), beside the
  rollout's settings (a turn longer than the episode's token budget); `episodes` refuses a kind with nothing to
  run (no environment or agent named), before any model loads;
- `scored_by_task`: whether the task's reward scores the episodes (else the environment or the agent does);
- `torchrun_refusal`: why the kind cannot run under torchrun ('' when it can);
- `noun`: what the run's messages call the thing that writes the episodes (environment, agent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from dppo._checks import config_fail as _fail
from dppo._checks import config_json_object as _json_object
from dppo._checks import config_positive as _positive
from dppo._extras import require_extra
from dppo.episodes.agent_loop import AGENTS, AgentEpisodes
from dppo.episodes.env_loop import EnvEpisodes
from dppo.episodes.single import SingleAnswer


@dataclass(frozen=True)
class SingleSettings:
    """A single answer per prompt, a one-turn episode scored by the task's reward (`dppo.episodes.single`)."""

    scored_by_task: ClassVar[bool] = True
    torchrun_refusal: ClassVar[str] = ""
    noun: ClassVar[str] = "answer"
    default_top_k: ClassVar[int] = 0
    """K of µ's top-K the engine records when rollout.top_k_logprobs is unset and the trust region needs none."""

    @property
    def max_turns(self) -> int:
        return 1

    def check_run(self, *, max_new_tokens: int) -> None:
        """Nothing to refuse: an answer's length is rollout.max_new_tokens."""

    def episodes(self, *, max_new_tokens: int, reward=None) -> SingleAnswer:
        """The answers (of up to `max_new_tokens` tokens, rollout.max_new_tokens), scored by `reward` (the task's
        `RewardRunner`; None: episodes that only collect)."""
        return SingleAnswer(max_new_tokens, reward=reward)


@dataclass(frozen=True)
class EnvSettings:
    """Multi-turn episodes (rollout.episodes env; docs/agents.md): an environment answers each assistant turn. The
    episode limits' defaults live here only, checked here once (`dppo.episodes.env_loop` runs the episodes with these
    settings)."""

    name: str = ""
    """An environment (calculator, python, feedback, mcp: an MCP server's tools, openenv: an OpenEnv server's) or
    `module:Class` / `path/to/file.py:Class`."""
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
    noun: ClassVar[str] = "environment"
    default_top_k: ClassVar[int] = 0

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

    def check_run(self, *, max_new_tokens: int) -> None:
        if max_new_tokens > self.max_tokens:
            _fail("rollout.max_new_tokens", f"{max_new_tokens} (one turn) > env.max_tokens {self.max_tokens} "
                                            f"(the whole episode)")

    def episodes(self, *, max_new_tokens: int, reward=None) -> EnvEpisodes:
        """The environment's episodes: these settings are all they need (the environment scores each episode)."""
        if not self.name:
            _fail("env.name", "rollout.episodes env needs an environment (calculator, python, feedback, mcp, openenv, "
                              "module:Class or path/to/file.py:Class)")
        return EnvEpisodes(self)


@dataclass(frozen=True)
class AgentSettings:
    """An agent written against an OpenAI client, trained through dppo's recording proxy (rollout.episodes agent;
    docs/agents.md, "Bring your own agent"): `agent(client, example) -> reward`; each call's tokens, µ and µ's top-K
    are recorded and joined into rows (a row's response tokens are capped by max_tokens, each call by
    rollout.max_new_tokens)."""

    name: str = ""
    """The agent function, `module:function` or `path/to/file.py:function` (sync: gets an openai.OpenAI; async:
    an openai.AsyncOpenAI), or a built-in: `verifiers` (a verifiers v1 taskset, --task.name verifiers)."""
    max_calls: int = 16
    """Calls per episode; past it a call is refused (the agent sees an OpenAI error)."""
    max_tokens: int = 256
    """Response tokens of a row (the calls joined into it, generated and inserted tokens together); a call past it
    is refused (the agent sees OpenAI's context_length_exceeded) and counted as truncated."""
    timeout_s: float = 120.0
    """Longest an episode may run (its agent, all its calls); past it the episode ends with reward 0, counted."""
    concurrency: int = 0
    """Episodes running at once (0 = all of the step's prompts_per_step x group_size)."""
    host: str = "127.0.0.1"
    """Where the proxy listens. Anything but a loopback address exposes it: then every request needs the run's
    key (`Authorization: Bearer`, passed as the client's api_key)."""
    port: int = 0
    """The proxy's port (0 = a free one)."""
    url: str = ""
    """An agent behind HTTP instead of a function (dppo.episodes.agent_service): each episode is posted to this URL
    (http:// or https://) with the episode's base URL and key; the service answers its reward. Exclusive with name."""
    post_retries: int = 2
    """A post that did not reach the agent service (connection refused, 502/503/504) is sent again this many times."""
    advertise_host: str = ""
    """The host in the base URLs agents get ('' = host; 127.0.0.1 when host is 0.0.0.0): set it to this machine's
    address when the agent service runs on another one."""
    max_request_bytes: int = 1 << 20
    """Largest request body the proxy reads (413 past it)."""
    max_concurrent_requests: int = 256
    """Requests in flight at once (429 past it)."""

    scored_by_task: ClassVar[bool] = False
    noun: ClassVar[str] = "agent"
    default_top_k: ClassVar[int] = 1
    """µ's top-1: the `top_logprobs` OpenAI clients ask by default (SkyRL: 1; verifiers' TrainClient: `logprobs: 1`)
    is answered; it costs one max over the vocabulary a token."""
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
        if self.name and self.url:
            _fail("agent.url", "an agent is a function (agent.name) or a service (agent.url), not both")
        if self.url and not self.url.startswith(("http://", "https://")):
            _fail("agent.url", f"expected an http:// or https:// URL, got {self.url!r}")
        if self.post_retries < 0:
            _fail("agent.post_retries", f"expected >= 0, got {self.post_retries}")
        if self.name and ":" not in self.name and self.name not in AGENTS:
            _fail("agent.name", f"expected a built-in agent ({', '.join(AGENTS)}), 'module:function' or "
                                f"'path/to/file.py:function', got {self.name!r}")
        if self.max_tokens < 1:
            _fail("agent.max_tokens", f"expected >= 1, got {self.max_tokens}")

    def check_run(self, *, max_new_tokens: int) -> None:
        require_extra("agents", "rollout.episodes", "'agent' (the recording proxy and the agent's OpenAI client)")
        if max_new_tokens > self.max_tokens:
            _fail("rollout.max_new_tokens", f"{max_new_tokens} (one call) > agent.max_tokens {self.max_tokens} "
                                            f"(a row)")

    @property
    def max_turns(self) -> int:
        """An agent's turns are its calls: each generated token's turn is the call that sampled it."""
        return self.max_calls

    def episodes(self, *, max_new_tokens: int, reward=None) -> AgentEpisodes:
        """The agent's episodes, each of its rows holding up to max_tokens response tokens (each call's tokens are
        capped by the sampling parameters' max_new_tokens). The agent scores each episode."""
        if not self.name and not self.url:
            _fail("agent.name", "rollout.episodes agent needs an agent ('module:function' or "
                                "'path/to/file.py:function', or a service: agent.url)")
        return AgentEpisodes(self)


EPISODE_KINDS: dict[str, type] = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings}
"""Episode kind -> its settings class (the run config's section of the same name holds an instance; the single
answer has none)."""


__all__ = ["AgentSettings", "EPISODE_KINDS", "EnvSettings", "SingleSettings"]
