"""The agent proxy's engine side: concurrent calls batched into engine calls, in the thread that owns the engine.

    batcher = Batcher(batch_wait_s=0.2)
    result = await batcher.submit(episode, context_ids, max_new)     # on the proxy's event loop (one per call)
    batcher.serve(engine, params, active=..., finished=...)          # in the engine's thread, until all have ended

Requests are not answered one by one: `serve` takes every call waiting once all running episodes have one in
flight (`active()`), or `batch_wait_s` after the last one arrived, and answers them with one `engine.generate` call
per distinct max_new_tokens, in the episodes' order (so a batch is the one an environment's episodes would make;
each engine call is seeded by `turn_seed`) — P x G agents running concurrently cost what P x G environment
episodes cost. A call whose context does not fit the engine fails alone; an engine failure fails every call of its
batch, then raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable

from dppo.episodes.agent_rows import ProxyEpisode
from dppo.episodes.proxy_requests import RequestError
from dppo.episodes.records import turn_seed
from dppo.rollout.base import SamplingParams


@dataclass
class _Call:
    episode: ProxyEpisode
    context: list[int]
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Batcher:
    """The calls waiting for the engine (module docstring)."""

    def __init__(self, batch_wait_s: float = 0.2) -> None:
        self.batch_wait_s = batch_wait_s
        """Longest wait, after the last call arrived, for the other running episodes' calls before a batch is taken."""
        self._pending: list[_Call] = []
        self._cond = threading.Condition()
        self._last_arrival = 0.0
        self.batch_sizes: list[int] = []
        """Calls per engine call, every engine call of the batcher's life (benchmarks and tests read it)."""

    async def submit(self, episode: ProxyEpisode, context: list[int], max_new: int):
        """The engine's `Rollout` for `context` (up to `max_new` new tokens), once `serve` answered it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._pending.append(_Call(episode, context, max_new, future, loop))
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        return await future

    def wake(self) -> None:
        """An episode ended: the serving thread re-checks whether the batch is complete."""
        with self._cond:
            self._cond.notify_all()

    def serve(self, engine, params: SamplingParams, *, active: Callable[[], int], finished: Callable[[], bool],
              prefix_tokens: int = 0) -> None:
        """Answer calls with `engine` until `finished()` (every episode ended) and no call waits. The engine's prefix
        cache (the hf engine's; `prefix_tokens` positions) is on meanwhile: a call that extends an earlier one
        prefills only its new tokens."""
        engine.enable_prefix_cache(prefix_tokens)
        try:
            self._serve(engine, params, active, finished)
        finally:
            engine.enable_prefix_cache(0)

    def _take(self, active, finished) -> list[_Call] | None:
        """The next batch (None: every episode ended and no call waits)."""
        wait = self.batch_wait_s
        with self._cond:
            while not self._pending and not finished():
                self._cond.wait(0.05)
            if not self._pending:
                return None
            while len(self._pending) < active() and time.monotonic() < self._last_arrival + wait:
                self._cond.wait(max(self._last_arrival + wait - time.monotonic(), 0.001))
            calls, self._pending = self._pending, []
        return calls

    def _serve(self, engine, params: SamplingParams, active, finished) -> None:
        batch = 0
        while True:
            calls = self._take(active, finished)
            if calls is None:
                return
            calls = sorted((c for c in calls if not _dropped(c)), key=lambda c: c.episode.order)
            if not calls:
                continue
            if batch > 0 and engine.between_chunks is not None:  # in-flight updates: newer weights between calls
                engine.between_chunks()
            for max_new in sorted({c.max_new for c in calls}):
                group = [c for c in calls if c.max_new == max_new]
                call_params = dataclasses.replace(params, n=1, max_new_tokens=max_new, seed=turn_seed(params.seed, batch))
                self._generate(engine, group, call_params)
                self.batch_sizes.append(len(group))
                batch += 1

    def _generate(self, engine, group: list[_Call], params: SamplingParams) -> None:
        try:
            results = engine.generate([c.context for c in group], params)
        except ValueError:
            if len(group) == 1:  # one bad call (its context too long for the engine): only it fails
                results = None
            else:
                for c in group:
                    self._generate(engine, [c], params)
                return
        except Exception as err:  # noqa: BLE001 - an engine failure: every call of the batch gets it, then raise
            for c in group:
                c.loop.call_soon_threadsafe(_set, c.future, None, RequestError(
                    f"the engine failed: {type(err).__name__}: {err}", None, code="engine_error", status=500))
            raise
        if results is None:
            group[0].loop.call_soon_threadsafe(_set, group[0].future, None, RequestError(
                f"the prompt ({len(group[0].context)} tokens) does not fit the engine's context", "messages",
                code="context_length_exceeded"))
            return
        for c, r in zip(group, results):
            c.loop.call_soon_threadsafe(_set, c.future, r, None)


def _dropped(call: _Call) -> bool:
    """Whether the call's episode ended meanwhile (the call then gets 410)."""
    if call.episode.closed:
        call.loop.call_soon_threadsafe(_set, call.future, None, RequestError(
            "this episode has ended", None, code="episode_ended", status=410))
        return True
    return False


def _set(future: asyncio.Future, value, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


__all__ = ["Batcher"]
