"""Agents as users write them, run as a run's episodes: `agent(client, example) -> reward` against the proxy.

    # my_agent.py — dppo train --agent.name my_agent.py:solve
    def solve(client, example):            # client: an openai.OpenAI whose base_url is this episode's proxy URL
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return 1.0 if ... else 0.0         # the episode's reward (or None after POSTing it to <base>/../reward)

`async def solve(client, example)` gets an `openai.AsyncOpenAI` instead. `AgentSpec` is the run's `Episodes`
(`dppo.rollout.episodes`): its collector opens P x G episodes on the proxy (`dppo.agents.proxy`, started once per
process, where the engine is), runs the agents on the proxy's event loop (`agent.concurrency` at a time; a sync
agent in its own daemon thread), each bounded by `agent.timeout_s`, and serves their calls with the engine from
the calling thread until all have ended. An agent that raises, hangs past its timeout or returns something other
than a finite number ends its episode with reward 0, its error named in the samples file and counted
(`episode/env_errors`, `episode/env_timeouts`); the run goes on. Its calls become rows (`dppo.agents.rows`).

The agent runs in the trainer's process, with the trainer's user's rights — no more than the user's own code
already has; the sandbox (`dppo.envs.sandbox`) is for code the *model* writes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

from dppo.agents.proxy import Proxy, ProxySettings
from dppo.rollout.base import Rollout, SamplingParams
from dppo.rollout.episodes import first_rows
from dppo.runtime.plugins import load_object


PROMPT_ROOM = 1024
"""Prompt positions per episode the engine's prefix cache is sized for (beside its rows' `max_tokens`)."""


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
class AgentSpec:
    """The run's agent episodes (picklable: rollout workers receive it; the proxy is started where it runs). The
    limits have no defaults here: the run config's `AgentConfig` owns them (`dppo.train.build.agent_spec`)."""

    agent: str
    max_calls: int = field(kw_only=True)
    max_tokens: int = field(kw_only=True)
    """A row's response tokens (env.max_tokens)."""
    timeout_s: float = field(kw_only=True)
    concurrency: int = field(kw_only=True)
    host: str = field(kw_only=True)
    port: int = field(kw_only=True)
    max_request_bytes: int = field(kw_only=True)
    max_concurrent_requests: int = field(kw_only=True)

    @property
    def max_turns(self) -> int:
        """Calls per episode (the per-turn metrics count calls)."""
        return self.max_calls

    def settings(self) -> ProxySettings:
        return ProxySettings(host=self.host, port=self.port, max_calls=self.max_calls, max_tokens=self.max_tokens,
                             max_request_bytes=self.max_request_bytes, max_concurrent=self.max_concurrent_requests)

    def collector(self) -> "AgentCollector":
        return AgentCollector(self)

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Nothing to do: each agent returned (or posted) its episode's reward."""

    def check(self, example) -> str | None:
        kind = "async" if inspect.iscoroutinefunction(load_agent(self.agent)) else "sync"
        return (f"[dppo] agent {self.agent!r} ({kind}) through the OpenAI-compatible proxy on {self.host} "
                f"(a base URL per episode); it runs with this process's rights")

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Per episode: calls (`turns`), the model's tool calls, rows, refused calls; the truncated share, the share
        of inserted tokens among the response tokens, errors and timeouts (totals)."""
        eps = [r.episode for r in first_rows(rollouts)]
        n = len(eps)
        tokens = sum(int(r.response_ids.numel()) for r in rollouts)
        inserted = sum(int((~r.loss_mask).sum()) for r in rollouts)
        return {"episode/turns_mean": sum(e.turns for e in eps) / n,
                "episode/tool_calls_mean": sum(e.tool_calls for e in eps) / n,
                "episode/rows_mean": len(rollouts) / n,
                "episode/refused_calls_mean": sum(e.refused_calls for e in eps) / n,
                "episode/truncated_frac": sum(e.truncated for e in eps) / n,
                "episode/env_token_frac": inserted / max(tokens, 1),
                "episode/generated_tokens_mean": (tokens - inserted) / n,
                "episode/env_errors": float(sum(e.env_errors for e in eps)),
                "episode/env_timeouts": float(sum(e.env_timeouts for e in eps))}


class AgentCollector:
    """`collect(engine, examples, params)`: params.n agent episodes per example (module docstring)."""

    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec
        self.proxy: Proxy | None = None
        self._fn = None
        self._clients = None

    def __getstate__(self):
        return {"spec": self.spec}

    def __setstate__(self, state) -> None:
        self.__init__(state["spec"])

    def close(self) -> None:
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

            limits = httpx.Limits(max_connections=self.spec.max_concurrent_requests,
                                  max_keepalive_connections=self.spec.max_concurrent_requests)
            self._clients = (httpx.Client(limits=limits), httpx.AsyncClient(limits=limits))
        return self._clients

    def __call__(self, engine, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        if self.proxy is None:
            self._fn = load_agent(self.spec.agent)
            self.proxy = Proxy(self.spec.settings())
            self.proxy.start()
        proxy = self.proxy
        episodes = [proxy.open(p, ex) for p, ex in enumerate(examples) for _ in range(params.n)]
        state = {"active": 0, "left": len(episodes)}
        proxy.begin(engine, params)
        done = asyncio.run_coroutine_threadsafe(self._run_all(episodes, state), proxy.loop)
        try:
            proxy.serve(engine, params, active=lambda: state["active"], finished=lambda: state["left"] == 0,
                        prefix_tokens=len(episodes) * (self.spec.max_tokens + PROMPT_ROOM))
            done.result()
        finally:
            proxy.close_episodes()
        eos = engine.tokenizer.eos_token_id
        return [r for ep in episodes for r in ep.rollouts(eos, engine.weight_version)]

    async def _run_all(self, episodes, state) -> None:
        limit = asyncio.Semaphore(self.spec.concurrency or len(episodes))

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

        spec, fn, url = self.spec, self._fn, self.proxy.base_url(ep)
        common = {"base_url": url, "api_key": self.proxy.key, "max_retries": 0, "timeout": spec.timeout_s}
        http_sync, http_async = self._http()  # (shared: a new client per episode costs ~30 ms of SSL set-up)
        try:
            if inspect.iscoroutinefunction(fn):
                client = openai.AsyncOpenAI(**common, http_client=http_async)
                value = await asyncio.wait_for(fn(client, ep.example), spec.timeout_s)
            else:
                client = openai.OpenAI(**common, http_client=http_sync)
                value = await asyncio.wait_for(asyncio.wrap_future(_in_thread(fn, client, ep.example)), spec.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            ep.timed_out, ep.error = True, f"agent {spec.agent!r}: timed out after {spec.timeout_s:g}s"
            return
        except Exception as err:  # noqa: BLE001 - contained: the episode ends, counted and named
            ep.error = f"agent {spec.agent!r}: {type(err).__name__}: {err}"[:2000]
            return
        if value is None:
            value = ep.posted
        if value is None:
            ep.error = f"agent {spec.agent!r}: returned None and posted no reward"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            ep.error = f"agent {spec.agent!r}: returned {value!r:.100}, expected a finite number (the reward)"
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


__all__ = ["AgentCollector", "AgentSpec", "load_agent"]
