"""Isolation "thread": the reward runs in `workers` daemon threads; a call past the limit is abandoned.

An abandoned call keeps running (Python cannot stop a thread) but its result is dropped and its thread
replaced, so the batch finishes on time. Cheap and works for any callable (lambdas, closures), but a reward
that never returns keeps a CPU busy until the process exits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from dppo.example import Example, RewardFn
from dppo.rewards.strategy import Outcomes
from dppo.rewards.worker import score_item, warm_up


class ThreadStrategy:
    """A fresh set of `workers` daemon threads per call, taking items from one queue."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, workers: int, startup_timeout_s: float):
        self.fn = fn
        self.timeout_s = timeout_s
        self.workers = workers
        warm_up(fn)

    def start(self) -> None:
        pass

    def run(self, completions: Sequence[str], examples: Sequence[Example], out: Outcomes) -> None:
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(examples)):
            todo.put(i)
        results: queue.SimpleQueue[tuple[int, float | None, str | None]] = queue.SimpleQueue()
        slots = [_ThreadSlot(self.fn, completions, examples, todo, results) for _ in range(self.workers)]
        while out.remaining:
            now = time.monotonic()
            deadlines = [s.deadline(self.timeout_s) for s in slots]
            wait = min([d for d in deadlines if d is not None], default=now + 1.0) - now
            try:
                out.result(*results.get(timeout=max(wait, 0.0)))
                continue
            except queue.Empty:
                pass
            for k, slot in enumerate(slots):
                index = slot.abandon_if_late(self.timeout_s)
                if index is not None:
                    out.timeout(index)
                    slots[k] = _ThreadSlot(self.fn, completions, examples, todo, results)
        for slot in slots:
            slot.stop()

    def close(self) -> None:
        pass


class _ThreadSlot:
    """One daemon thread taking indices from `todo`; abandoned (never joined) when a call runs too long."""

    def __init__(self, fn, completions, examples, todo, results):
        self._lock = threading.Lock()
        self._current: tuple[int, float] | None = None
        self._abandoned = False
        args = (fn, completions, examples, todo, results)
        self._thread = threading.Thread(target=self._loop, args=args, daemon=True)
        self._thread.start()

    def _loop(self, fn, completions, examples, todo, results) -> None:
        while True:
            with self._lock:
                if self._abandoned:
                    return
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    self._current = None
                    return
                self._current = (index, time.monotonic())
            value, error = score_item(fn, completions[index], examples[index])
            with self._lock:
                self._current = None
                if self._abandoned:
                    return
                results.put((index, value, error))

    def deadline(self, timeout_s: float) -> float | None:
        current = self._current
        return None if current is None else current[1] + timeout_s

    def abandon_if_late(self, timeout_s: float) -> int | None:
        with self._lock:
            if self._current is None or time.monotonic() - self._current[1] <= timeout_s:
                return None
            self._abandoned = True
            return self._current[0]

    def stop(self) -> None:
        with self._lock:
            self._abandoned = True
