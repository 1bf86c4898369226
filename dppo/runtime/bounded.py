"""Bounded calls: run functions in daemon threads, each given a time limit, and say how each one ended.

    outcomes = bounded_calls([lambda: env.step(reply) for ...], timeout_s=30.0)     # all at once
    outcomes = bounded_calls(calls, timeout_s=10.0, workers=4)                      # at most 4 at a time
    outcome.status in ("ok", "error", "timeout"); outcome.value / outcome.error

The one implementation behind every call that must not hang or crash the trainer: a reward with isolation
"thread" (`dppo.rewards.threads`), a tool call (`dppo.envs.tools.call_tool`), an environment's reset and step
(`dppo.episodes.env_loop`). A call's clock starts when it is handed to its thread; a call past `timeout_s` is
abandoned (Python cannot stop a thread: it keeps running in the background, its result dropped) and its slot goes to
the next call, so the batch returns on time. An exception (any `BaseException`) is caught and returned, never raised.

The threads are pooled: a finished call's thread waits, idle, for the next call (up to `MAX_IDLE` of them), so a
call costs a queue hand-off, not a thread start. A new `threading.Thread` waits for the thread to run before
`start()` returns; an episode step hands 256 environment calls over at once, and that handshake, each one a GIL
hand-off, was half of a multi-turn step on the tiny model with both cores busy (11.4 of 24.4 s over 6 steps of
`tests/train/test_learning.py`'s feedback run, profiled). An abandoned call's thread rejoins the pool when its call
returns. A forked child starts with an empty pool (the parent's threads do not exist there).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

Status = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class Outcome:
    """How one bounded call ended."""

    status: Status
    value: Any = None
    """The call's return value (status "ok")."""
    error: BaseException | None = None
    """What it raised (status "error")."""


MAX_IDLE = 1024
"""Idle pooled threads kept for later calls; a thread finishing a call when this many are idle ends."""


class _Pool:
    """Daemon threads that run one call at a time, each from its own inbox, and wait idle between calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []
        self._ids = itertools.count()

    def submit(self, fn: Callable[[], Any], i: int, name: str, finished: queue.SimpleQueue) -> None:
        """Run fn() in an idle thread (a new one when none is idle); (i, Outcome) goes to `finished`."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=f"dppo-bounded-{next(self._ids)}",
                             daemon=True).start()
        inbox.put((fn, i, name, finished))

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        thread = threading.current_thread()
        while True:
            fn, i, name, finished = inbox.get()
            thread.name = f"{name}-{i}"  # (tracebacks and thread dumps name the call)
            try:
                outcome = Outcome("ok", fn())
            except BaseException as exc:  # noqa: BLE001 - returned to the caller, which reports it
                outcome = Outcome("error", error=exc)
            fn = None  # drop the call (and what it holds) before idling
            with self._lock:
                keep = len(self._idle) < MAX_IDLE
                if keep:
                    self._idle.append(inbox)
            finished.put((i, outcome))
            outcome = finished = None
            if not keep:
                return

    def forget(self) -> None:
        """In a forked child: the parent's threads are not there, so none is idle."""
        self._lock = threading.Lock()
        self._idle = []


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)


def bounded_calls(fns: Sequence[Callable[[], Any]], timeout_s: float | None, *, workers: int | None = None,
                  name: str = "dppo-bounded") -> list[Outcome]:
    """Run every fn() in a daemon thread of its own, at most `workers` at once (None: all at once), each given
    `timeout_s` seconds from its start (None: no limit). Returns one `Outcome` per fn, in order."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0 or None, got {timeout_s}")
    n = len(fns)
    width = n if workers is None else max(1, min(workers, n))
    results: list[Outcome | None] = [None] * n
    finished: queue.SimpleQueue = queue.SimpleQueue()
    running: dict[int, float] = {}  # index -> start time
    todo = iter(range(n))

    def launch() -> None:
        i = next(todo, None)
        if i is not None:
            running[i] = time.monotonic()
            _POOL.submit(fns[i], i, name, finished)

    for _ in range(width):
        launch()
    while running:
        wait = None if timeout_s is None else max(0.0, min(running.values()) + timeout_s - time.monotonic())
        try:
            i, outcome = finished.get(timeout=wait)
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, t0 in running.items() if now - t0 >= timeout_s]:
                results[i] = Outcome("timeout")
                del running[i]
                launch()
            continue
        if i in running:  # (a result arriving after its timeout is dropped)
            results[i] = outcome
            del running[i]
            launch()
    return results  # type: ignore[return-value]


__all__ = ["Outcome", "bounded_calls"]
