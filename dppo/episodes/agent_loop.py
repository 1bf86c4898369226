"""Agents as users write them, run as a run's episodes: `agent(client, example) -> reward` against the proxy.

    # my_agent.py — dppo train --rollout.episodes agent --agent.name my_agent.py:solve
    def solve(client, example):            # client: an openai.OpenAI whose base_url is this episode's proxy URL
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return 1.0 if ... else 0.0         # the episode's reward (or None after POSTing it to <base>/../reward)

`async def solve(client, example)` gets an `openai.AsyncOpenAI` instead. `AgentEpisodes` are the run's episodes of
every kind played through the proxy: an agent (`dppo.episodes.settings.AgentSettings.episodes`) or a verifiers
taskset (`VerifiersSettings.episodes`, its player `dppo.episodes.verifiers.Player`): its collector opens P x G
episodes on the proxy (`dppo.episodes.proxy`, started once per process, where the engine is), runs the agents on
the proxy's event loop (`concurrency` at a time; a sync agent in its own daemon thread), each bounded by
`timeout_s`, and serves their calls with the engine from the calling thread until all have ended. An agent that
raises, hangs past its timeout or returns something other than a finite number ends its episode with reward
0, its error named in the samples file and counted (`episode/env_errors`, `episode/env_timeouts`); the run goes
on. Its calls become rows (`dppo.episodes.agent_rows`).

The agent runs in the trainer's process, with the trainer's user's rights — no more than the user's own code
already has; the sandbox (`dppo.envs.sandbox`) is for code the *model* writes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

from dppo.episodes.errors import describe_error
from dppo.episodes.proxy import Proxy
from dppo.episodes.results import episode_metrics
from dppo.rollout.base import Rollout, SamplingParams
from dppo.runtime.plugins import load_object

PROMPT_ROOM = 1024
"""Prompt positions per episode the engine's prefix cache is sized for (beside its rows' `max_tokens`)."""

COUNTERS = ("turns", "tool_calls", "rows", "refused_calls")
"""What an agent's episodes count, reported as means per episode (`episode/<name>_mean`): calls (`turns`), the
model's tool calls, rows, calls the proxy refused."""


def load_agent(name: str):
    """The agent function `name` ('module:function' or 'path/to/file.py:function'), checked to take (client,
    example); ValueError naming it otherwise."""
    fn, _ = load_object(name, kind="agent")
    if not callable(fn):
        raise ValueError(f"agent {name!r}: not callable")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as err:
        raise ValueError(f"agent {name!r}: must take (client, example): {err}") from err
    except ValueError:  # (no signature: a builtin)
        pass
    return fn


@dataclass(frozen=True)
class AgentEpisodes:
    """The run's episodes through the proxy (`dppo.rollout.source.Episodes`, picklable: rollout workers receive them;
    the proxy is started where they run): the proxy's settings and what plays each episode."""

    settings: Any
    """The run config's `proxy` section, a `dppo.episodes.settings.ProxySettings` (given to the `episodes` of
    `AgentSettings` or `VerifiersSettings`, which build these episodes): the episodes' limits and the proxy's
    settings."""
    player: Any
    """What plays each episode (picklable): `agent()` -> the agent function `agent(client, example) -> reward`,
    loaded where the episodes run; `label` (its name in the run's messages); `start_line(host)`. The `agent` section
    plays its own; a verifiers taskset's is `dppo.episodes.verifiers.Player`."""

    @property
    def max_tokens(self) -> int:
        """A row's response tokens (proxy.max_tokens)."""
        return self.settings.max_tokens

    @property
    def max_turns(self) -> int:
        """Calls per episode, proxy.max_calls (the per-turn metrics and the loss's per-turn units count calls)."""
        return self.settings.max_calls

    def collector(self) -> "AgentCollector":
        return AgentCollector(self.settings, self.player)

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Nothing to do: each agent returned (or posted) its episode's reward."""

    def check(self, example) -> str | None:
        return self.player.start_line(self.settings.host)

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        return episode_metrics(rollouts, COUNTERS)


class AgentCollector:
    """`collect(engine, examples, params)`: params.n agent episodes per example (module docstring)."""

    def __init__(self, settings, player) -> None:
        self.settings, self.player, self.max_tokens = settings, player, settings.max_tokens
        self.proxy: Proxy | None = None
        self._fn = None
        self._clients = None

    def __getstate__(self):
        return {"settings": self.settings, "player": self.player}

    def __setstate__(self, state) -> None:
        self.__init__(state["settings"], state["player"])

    def close(self) -> None:
        closing = getattr(self._fn, "close", None)  # an agent's own clean-up (e.g. a verifiers taskset's)
        if self.proxy is not None and self.proxy.loop is not None and inspect.iscoroutinefunction(closing):
            try:
                asyncio.run_coroutine_threadsafe(closing(), self.proxy.loop).result(30)
            except Exception as err:  # noqa: BLE001 - a failed clean-up must not hide the run's result
                print(f"[dppo] agent clean-up failed: {type(err).__name__}: {err}", flush=True)
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self._clients is not None:
            self._clients[0].close()
            self._clients = None

    def _http(self):
        """The httpx clients every episode's OpenAI client shares (sync; async, bound to the proxy's loop)."""
        if self._clients is None:
            import httpx

            n = self.settings.max_concurrent_requests
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
            self._clients = (httpx.Client(limits=limits), httpx.AsyncClient(limits=limits))
        return self._clients

    def __call__(self, engine, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        if self.proxy is None:
            self._fn = self.player.agent()
            self.proxy = Proxy(self.settings)
            self.proxy.start()
        proxy = self.proxy
        episodes = [proxy.open(p, ex) for p, ex in enumerate(examples) for _ in range(params.n)]
        state = {"active": 0, "left": len(episodes)}
        proxy.begin(engine, params)
        done = asyncio.run_coroutine_threadsafe(self._run_all(episodes, state), proxy.loop)
        try:
            proxy.serve(engine, params, active=lambda: state["active"], finished=lambda: state["left"] == 0,
                        prefix_tokens=len(episodes) * (self.max_tokens + PROMPT_ROOM))
            done.result()
        finally:
            proxy.close_episodes()
        eos = engine.tokenizer.eos_token_id
        return [r for ep in episodes for r in ep.rollouts(eos, engine.weight_version)]

    async def _run_all(self, episodes, state) -> None:
        limit = asyncio.Semaphore(self.settings.concurrency or len(episodes))

        async def one(ep) -> None:
            async with limit:
                state["active"] += 1
                try:
                    await self._run_one(ep)
                finally:
                    ep.closed = True
                    state["active"] -= 1
                    state["left"] -= 1
                    self.proxy.wake()

        await asyncio.gather(*(one(ep) for ep in episodes))

    async def _run_one(self, ep) -> None:
        import openai

        s, fn, url = self.settings, self._fn, self.proxy.base_url(ep)
        label = self.player.label
        common = {"base_url": url, "api_key": self.proxy.key, "max_retries": 0, "timeout": s.timeout_s}
        http_sync, http_async = self._http()  # (shared: a new client per episode costs ~30 ms of SSL set-up)
        try:
            if inspect.iscoroutinefunction(fn):
                client = openai.AsyncOpenAI(**common, http_client=http_async)
                value = await asyncio.wait_for(fn(client, ep.example), s.timeout_s)
            else:
                client = openai.OpenAI(**common, http_client=http_sync)
                value = await asyncio.wait_for(asyncio.wrap_future(_in_thread(fn, client, ep.example)), s.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            ep.timed_out, ep.error = True, f"agent {label!r}: timed out after {s.timeout_s:g}s"
            return
        except Exception as err:  # noqa: BLE001 - contained: the episode ends, counted and named
            ep.error = f"agent {label!r}: {describe_error(err)}"[:2000]
            return
        if value is None:
            value = ep.posted
        if value is None:
            ep.error = f"agent {label!r}: returned None and posted no reward"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            ep.error = f"agent {label!r}: returned {value!r:.100}, expected a finite number (the reward)"
        else:
            ep.reward = float(value)


def _in_thread(fn, client, example) -> Future:
    """fn(client, example) in a daemon thread (a hanging agent is abandoned, never joined)."""
    out: Future = Future()

    def run() -> None:
        try:
            value, error = fn(client, example), None
        except BaseException as err:  # noqa: BLE001 - handed to the episode
            value, error = None, err
        if out.set_running_or_notify_cancel():  # (False: the episode timed out meanwhile and dropped it)
            out.set_exception(error) if error is not None else out.set_result(value)

    threading.Thread(target=run, name="dppo-agent", daemon=True).start()
    return out


__all__ = ["AgentCollector", "AgentEpisodes", "COUNTERS", "load_agent"]
