"""Bounded calls: run functions in daemon threads, each given a time limit, and say how each one ended.

    outcomes = bounded_calls([lambda: env.step(reply) for ...], timeout_s=30.0)     # all at once
    outcomes = bounded_calls(calls, timeout_s=10.0, workers=4)                      # at most 4 at a time
    outcome.status in ("ok", "error", "timeout"); outcome.value / outcome.error

The one implementation behind every call that must not hang or crash the trainer: a reward with isolation
"thread" (`dppo.rewards.threads`), a tool call (`dppo.envs.tools.call_tool`), an environment's reset and step
(`dppo.rollout.episodes`). A call's clock starts when its thread starts; a call past `timeout_s` is abandoned
(Python cannot stop a thread: it keeps running in the background, its result dropped) and its slot goes to the
next call, so the batch returns on time. An exception (any `BaseException`) is caught and returned, never raised.
"""

from __future__ import annotations

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


def bounded_calls(fns: Sequence[Callable[[], Any]], timeout_s: float | None, *, workers: int | None = None,
                  name: str = "dppo-bounded") -> list[Outcome]:
    """Run every fn() in its own daemon thread, at most `workers` at once (None: all at once), each given
    `timeout_s` seconds from its start (None: no limit). Returns one `Outcome` per fn, in order."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0 or None, got {timeout_s}")
    n = len(fns)
    width = n if workers is None else max(1, min(workers, n))
    results: list[Outcome | None] = [None] * n
    finished: queue.SimpleQueue = queue.SimpleQueue()
    running: dict[int, float] = {}  # index -> start time
    todo = iter(range(n))

    def run(i: int) -> None:
        try:
            finished.put((i, Outcome("ok", fns[i]())))
        except BaseException as exc:  # noqa: BLE001 - returned to the caller, which reports it
            finished.put((i, Outcome("error", error=exc)))

    def launch() -> None:
        i = next(todo, None)
        if i is not None:
            running[i] = time.monotonic()
            threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True).start()

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
