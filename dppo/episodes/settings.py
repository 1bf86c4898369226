"""The episode kinds' settings: one frozen class per kind, at once its config node and what its driver receives.

    EPISODE_KINDS = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings,
                     "verifiers": VerifiersSettings}

`EnvSettings` is the run config's `env` section, `AgentSettings` its `agent` section and `VerifiersSettings` its
`verifiers` section (`dppo.train.config` imports them; every default and every check lives here, once, each failure
naming `env.<field>` / `agent.<field>` / `verifiers.<field>`). The single answer has no settings. The recording proxy
that the `agent` and `verifiers` kinds play through has its own settings, `ProxySettings`, the run config's one
`proxy` section (failures name `proxy.<field>`), whichever of the two kinds runs; a kind declares that it runs through
the proxy (`uses_proxy`) and its `episodes` receives them. Each class gives the trainer what it needs, the same way
for every kind (`EpisodeKindSettings` holds the defaults):

- `episodes(max_new_tokens=..., reward=..., model=..., proxy=...)`: the run's episodes
  (`dppo.rollout.source.Episodes`, picklable: rollout workers receive them) from these settings and the run-time
  values the kind needs (the task's reward runner for a kind the task scores; the run's model for one that tokenises
  on its own side; the proxy's settings for a kind that `uses_proxy`); the episodes' `max_turns` bounds the loss's
  per-turn units (env.max_turns; the proxy's kinds: proxy.max_calls; 1 for a single answer);
- `uses_proxy`: whether the kind's episodes run through the recording proxy (its settings are the `proxy` section;
  a run of another kind refuses a changed `proxy.*` field);
- `supplies_examples`, `task(size=..., eval_size=..., seed=...)`: whether the kind supplies the run's examples (a
  verifiers taskset's tasks), and those examples, split by task.size / eval_size / seed (else the task section's task
  is the run's: the trainer's task building asks the kind first);
- `check_run(max_new_tokens=...)`: what the kind refuses once it is the run's choice (rollout.episodes), beside the
  rollout's settings (a turn longer than the episode's token budget, a missing extra; the proxy's own,
  `ProxySettings.check_run`, for a kind that uses it); `episodes` refuses a kind
  with nothing to run (no environment, agent or taskset named), before any model loads;
- `absolute_paths(base)`: the settings with every file they name made absolute against `base` (config.yaml then
  works from any directory);
- `scored_by_task`: whether the task's reward scores the episodes (else the environment, agent or taskset does);
- `torchrun_refusal`: why the kind cannot run under torchrun ('' when it can);
- `noun`: what the run's messages call the thing that writes the episodes (environment, agent).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from dppo._checks import config_fail as _fail
from dppo._checks import config_json_object as _json_object
from dppo._checks import config_positive as _positive
from dppo._extras import require_extra
from dppo.episodes.agent_loop import AgentEpisodes, load_agent
from dppo.episodes.agent_service import service_agent
from dppo.episodes.env_loop import EnvEpisodes
from dppo.episodes.single import SingleAnswer
from dppo.episodes.verifiers import CLIENTS, Player, is_local, verifiers_task
from dppo.runtime.plugins import absolute_spec
from dppo.tasks.base import Task


class EpisodeKindSettings:
    """What every episode kind's settings class declares, with the defaults most kinds keep (module docstring)."""

    torchrun_refusal: ClassVar[str] = ""
    default_top_k: ClassVar[int] = 0
    """K of µ's top-K the engine records when rollout.top_k_logprobs is unset and the trust region needs none."""
    supplies_examples: ClassVar[bool] = False
    """Whether the kind supplies the run's examples (`task`); the task section's name, options and system prompt then
    go unused (its size, eval_size and seed split the kind's examples)."""
    one_engine_call: ClassVar[bool] = False
    """Whether an episode is one engine call (a single answer): then several engines in one process can share a batch
    (`dppo.rollout.fleet` deals whole prompts per call; an episode of several calls would span engines)."""
    demonstrations: ClassVar[bool] = False
    """Whether its episodes come with demonstrations `dppo sft` can warm-start on (an environment's)."""
    uses_proxy: ClassVar[bool] = False
    """Whether the kind's episodes run through dppo's recording proxy: its `episodes` then plays them with the run's
    proxy settings (`ProxySettings`, the config's `proxy` section), which a run of another kind leaves at defaults."""

    def task(self, *, size: int, eval_size: int, seed: int) -> Task:
        """The run's examples, for a kind that supplies them (`supplies_examples`)."""
        raise NotImplementedError(f"{type(self).__name__} supplies no examples: the task section's task is the run's")

    def absolute_paths(self, base: Path):
        """These settings with every file they name absolute against `base` (none here)."""
        return self


@dataclass(frozen=True)
class SingleSettings(EpisodeKindSettings):
    """A single answer per prompt, a one-turn episode scored by the task's reward (`dppo.episodes.single`)."""

    scored_by_task: ClassVar[bool] = True
    noun: ClassVar[str] = "answer"
    one_engine_call: ClassVar[bool] = True

    @property
    def max_turns(self) -> int:
        return 1

    def check_run(self, *, max_new_tokens: int) -> None:
        """Nothing to refuse: an answer's length is rollout.max_new_tokens."""

    def episodes(self, *, max_new_tokens: int, reward=None, model: str = "", proxy=None) -> SingleAnswer:
        """The answers (of up to `max_new_tokens` tokens, rollout.max_new_tokens), scored by `reward` (the task's
        `RewardRunner`; None: episodes that only collect)."""
        return SingleAnswer(max_new_tokens, reward=reward)


@dataclass(frozen=True)
class EnvSettings(EpisodeKindSettings):
    """Multi-turn episodes (rollout.episodes env; docs/agents.md): an environment answers each assistant turn. The
    episode limits' defaults live here only, checked here once (`dppo.episodes.env_loop` runs the episodes with these
    settings)."""

    demonstrations: ClassVar[bool] = True

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
    noun: ClassVar[str] = "environment"

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

    @property
    def label(self) -> str:
        return self.name

    def absolute_paths(self, base: Path) -> "EnvSettings":
        return replace(self, name=absolute_spec(self.name, base))

    def episodes(self, *, max_new_tokens: int, reward=None, model: str = "", proxy=None) -> EnvEpisodes:
        """The environment's episodes: these settings are all they need (the environment scores each episode)."""
        if not self.name:
            _fail("env.name", "rollout.episodes env needs an environment (calculator, python, feedback, mcp, openenv, "
                              "module:Class or path/to/file.py:Class)")
        return EnvEpisodes(self)


@dataclass(frozen=True)
class ProxySettings:
    """dppo's recording proxy (`dppo.episodes.proxy.Proxy`, which takes these settings as they are): the run config's
    `proxy` section, the same for every episode kind played through it (`uses_proxy`: `agent`, `verifiers`), each
    kind's `episodes` receiving it; the episode's limits and the proxy's own settings, each check naming
    `proxy.<field>`."""

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
    advertise_host: str = ""
    """The host in the base URLs agents get ('' = host; 127.0.0.1 when host is 0.0.0.0): set it to this machine's
    address when the agent service runs on another one."""
    max_request_bytes: int = 1 << 20
    """Largest request body the proxy reads (413 past it)."""
    max_concurrent_requests: int = 256
    """Requests in flight at once (429 past it)."""

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            _fail("proxy.max_calls", f"expected >= 1, got {self.max_calls}")
        if self.concurrency < 0:
            _fail("proxy.concurrency", f"expected >= 0, got {self.concurrency}")
        if not 0 <= self.port <= 65535:
            _fail("proxy.port", f"expected 0..65535, got {self.port}")
        _positive("proxy", timeout_s=self.timeout_s, max_request_bytes=self.max_request_bytes,
                  max_concurrent_requests=self.max_concurrent_requests)
        if self.max_tokens < 1:
            _fail("proxy.max_tokens", f"expected >= 1, got {self.max_tokens}")

    def check_run(self, *, max_new_tokens: int, kind: str) -> None:
        """What the proxy refuses once episode kind `kind` (rollout.episodes) plays through it: a missing `agents`
        extra, a call longer than a row."""
        require_extra("agents", "rollout.episodes", f"{kind!r} (the recording proxy and the agent's OpenAI client)")
        if max_new_tokens > self.max_tokens:
            _fail("rollout.max_new_tokens", f"{max_new_tokens} (one call) > proxy.max_tokens {self.max_tokens} "
                                            f"(a row)")


class ProxyKindSettings(EpisodeKindSettings):
    """What the episode kinds played through the recording proxy declare alike (`AgentSettings`,
    `VerifiersSettings`); their `episodes` take the run's `ProxySettings` as `proxy`."""

    uses_proxy: ClassVar[bool] = True
    scored_by_task: ClassVar[bool] = False
    default_top_k: ClassVar[int] = 1
    """µ's top-1: the `top_logprobs` OpenAI clients ask by default (SkyRL: 1; verifiers' TrainClient: `logprobs: 1`)
    is answered; it costs one max over the vocabulary a token."""

    def check_run(self, *, max_new_tokens: int) -> None:
        """Nothing of the kind's own to refuse beside the proxy's (`ProxySettings.check_run`)."""


@dataclass(frozen=True)
class AgentSettings(ProxyKindSettings):
    """An agent written against an OpenAI client, trained through dppo's recording proxy (rollout.episodes agent;
    docs/agents.md, "Bring your own agent"): `agent(client, example) -> reward`; each call's tokens, µ and µ's top-K
    are recorded and joined into rows (a row's response tokens are capped by proxy.max_tokens, each call by
    rollout.max_new_tokens)."""

    name: str = ""
    """The agent function, `module:function` or `path/to/file.py:function` (sync: gets an openai.OpenAI; async:
    an openai.AsyncOpenAI)."""
    url: str = ""
    """An agent behind HTTP instead of a function (dppo.episodes.agent_service): each episode is posted to this URL
    (http:// or https://) with the episode's base URL and key; the service answers its reward. Exclusive with name."""
    post_retries: int = 2
    """A post that did not reach the agent service (connection refused, 502/503/504) is sent again this many times."""

    noun: ClassVar[str] = "agent"
    torchrun_refusal: ClassVar[str] = (
        "agent.name: agents under torchrun are not supported (their episodes' rows differ in number between ranks); "
        "run one process, with async rollout workers if needed")

    def __post_init__(self) -> None:
        if self.name and self.url:
            _fail("agent.url", "an agent is a function (agent.name) or a service (agent.url), not both")
        if self.url and not self.url.startswith(("http://", "https://")):
            _fail("agent.url", f"expected an http:// or https:// URL, got {self.url!r}")
        if self.post_retries < 0:
            _fail("agent.post_retries", f"expected >= 0, got {self.post_retries}")
        if self.name and ":" not in self.name:
            _fail("agent.name", f"expected 'module:function' or 'path/to/file.py:function', got {self.name!r}")

    @property
    def label(self) -> str:
        """How the run's messages name the agent: its service's URL or its function."""
        return self.url or self.name

    def agent(self):
        """The agent function (loaded where the episodes run): the service's poster, or agent.name loaded and
        checked (ValueError naming it)."""
        return service_agent(self.url, retries=self.post_retries) if self.url else load_agent(self.name)

    def start_line(self, host: str) -> str:
        if self.url:
            return (f"[dppo] agent service {self.url} (each episode posted to it) through the OpenAI-compatible proxy "
                    f"on {host} (a base URL per episode)")
        kind = "async" if inspect.iscoroutinefunction(self.agent()) else "sync"
        return (f"[dppo] agent {self.name!r} ({kind}) through the OpenAI-compatible proxy on {host} "
                f"(a base URL per episode); it runs with this process's rights")

    def absolute_paths(self, base: Path) -> "AgentSettings":
        return replace(self, name=absolute_spec(self.name, base))

    def episodes(self, *, max_new_tokens: int, reward=None, model: str = "",
                 proxy: ProxySettings = ProxySettings()) -> AgentEpisodes:
        """The agent's episodes through the proxy of settings `proxy` (the run's `proxy` section), each of its rows
        holding up to proxy.max_tokens response tokens (each call's tokens are capped by the sampling parameters'
        max_new_tokens). The agent scores each episode."""
        if not self.name and not self.url:
            _fail("agent.name", "rollout.episodes agent needs an agent ('module:function' or "
                                "'path/to/file.py:function', or a service: agent.url)")
        return AgentEpisodes(proxy, player=self)


@dataclass(frozen=True)
class VerifiersSettings(ProxyKindSettings):
    """A verifiers v1 taskset (rollout.episodes verifiers; docs/agents.md, "verifiers v1 tasksets"): its tasks are the
    run's examples (split by task.size, task.eval_size, task.seed), each played by verifiers' harness and client
    through dppo's recording proxy and scored by the taskset's own rewards (`dppo.episodes.verifiers`). The `train`
    client renders prompts with the run's model's tokenizer."""

    taskset: str = ""
    """A verifiers taskset id (an installed module or package, as `vf eval` takes it) or a local `.py` file or package
    folder."""
    options: str = "{}"
    """JSON object of the taskset config's fields (`--env.taskset.*` of `vf eval`), e.g. '{"num_tasks": 200}';
    checked by verifiers' own model before any model loads."""
    harness: str = ""
    """verifiers' harness: '' = the taskset's own if it ships one, else verifiers' `null` chat harness; any harness id
    (`null`, `bash`, ...) or a local file or package of one."""
    client: Literal["eval", "train"] = "eval"
    """verifiers' client: eval = `EvalClient` relays the harness's chat calls (chat completions); train =
    `TrainClient` renders prompts to token ids with `renderers` (the run's model's tokenizer) and calls the token
    route `/inference/v1/generate`."""
    shuffle: bool = True
    """Split the tasks in a seeded order (task.seed); false: the taskset's own order (for a taskset that lists its
    held-out tasks first)."""

    noun: ClassVar[str] = "verifiers taskset"
    supplies_examples: ClassVar[bool] = True
    torchrun_refusal: ClassVar[str] = (
        "rollout.episodes: verifiers episodes under torchrun are not supported (their episodes' rows differ in "
        "number between ranks); run one process, with async rollout workers if needed")

    def __post_init__(self) -> None:
        _json_object("verifiers.options", self.options)
        if self.client not in CLIENTS:
            _fail("verifiers.client", f"expected one of {CLIENTS}, got {self.client!r}")

    @property
    def label(self) -> str:
        return self.taskset

    def check_run(self, *, max_new_tokens: int) -> None:
        require_extra("verifiers", "rollout.episodes", "'verifiers' (a verifiers v1 taskset)")

    def task(self, *, size: int, eval_size: int, seed: int) -> Task:
        """The run's examples: the taskset's tasks, held out as `dppo.episodes.verifiers.verifiers_task` says."""
        return verifiers_task(self, size=size, eval_size=eval_size, seed=seed)

    def absolute_paths(self, base: Path) -> "VerifiersSettings":
        """The taskset and harness absolute when they name a local file or folder (an id is left to verifiers)."""
        local = {k: str((base / Path(v).expanduser()).resolve()) for k in ("taskset", "harness")
                 if is_local(v := getattr(self, k)) and not Path(v).expanduser().is_absolute()}
        return replace(self, **local)

    def episodes(self, *, max_new_tokens: int, reward=None, model: str = "",
                 proxy: ProxySettings = ProxySettings()) -> AgentEpisodes:
        """The taskset's episodes through the proxy of settings `proxy` (the run's `proxy` section): verifiers'
        harness and client play each (`Player`, with the run's model `model` for the train client's tokenizer); the
        taskset's rewards score it."""
        if not self.taskset:
            _fail("verifiers.taskset", "rollout.episodes verifiers needs a taskset (an installed taskset id, or a "
                                       "local .py file or package folder)")
        return AgentEpisodes(proxy, player=Player(self, tokenizer=model))


EPISODE_KINDS: dict[str, type] = {"single": SingleSettings, "env": EnvSettings, "agent": AgentSettings,
                                  "verifiers": VerifiersSettings}
"""Episode kind -> its settings class (the run config's section of the same name holds an instance; the single
answer has none)."""


__all__ = ["AgentSettings", "EPISODE_KINDS", "EnvSettings", "EpisodeKindSettings", "ProxyKindSettings", "ProxySettings",
           "SingleSettings", "VerifiersSettings"]
