"""What RewardRunner and an isolation strategy share: the `Strategy` protocol and the `Outcomes` it fills.

A strategy decides where a reward call runs (the calling thread, a daemon thread, a worker process) and how a
call past the limit is stopped. It records each item in `Outcomes` (`result` for a value or an error,
`timeout` for a call past the limit); RewardRunner turns the outcomes into the rewards tensor and the stats,
and checks them for NaN/inf. A new isolation is one class following `Strategy` plus one entry in
`dppo.rewards.runner.ISOLATION`; the shared tests in tests/rewards/test_rewards.py are parametrised over that registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dppo.example import Example, RewardFn

MAX_ERRORS_KEPT = 8


class Outcomes:
    """Per-item results of one runner call: value (None until done), plus counters and a few messages.

    The first outcome of an item counts; a later one (a result arriving after its timeout) is ignored.
    """

    def __init__(self, examples: Sequence[Example], timeout_s: float):
        self.examples = examples
        self.timeout_s = timeout_s
        self.values: list[float | None] = [None] * len(examples)
        self.done = [False] * len(examples)
        self.remaining = len(examples)
        self.failures = 0
        self.timeouts = 0
        self.errors: list[str] = []
        self.status: list[str] = ["ok"] * len(examples)
        """Per item: "ok", "failure" (raised, non-number, worker died) or "timeout"."""

    def _finish(self, index: int, value: float | None, message: str | None) -> None:
        if self.done[index]:
            return
        self.done[index] = True
        self.remaining -= 1
        self.values[index] = value
        if message is not None and len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"example {self.examples[index].uid}: {message}")

    def result(self, index: int, value: float | None, error: str | None) -> None:
        """Item `index` returned `value`, or failed with `error` (raised, non-number, worker died): 0.0."""
        if error is not None and not self.done[index]:
            self.failures += 1
            self.status[index] = "failure"
        self._finish(index, value if error is None else 0.0, error)

    def timeout(self, index: int) -> None:
        """Item `index` ran past the limit: 0.0."""
        if not self.done[index]:
            self.timeouts += 1
            self.status[index] = "timeout"
        self._finish(index, 0.0, f"timed out after {self.timeout_s:g} s")


class Strategy(Protocol):
    """Runs a reward over a batch in some isolation. Built once per RewardRunner and reused across calls."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, workers: int, startup_timeout_s: float):
        """fn: the reward. name: for error messages. timeout_s: limit per call. workers: how many calls at
        once. startup_timeout_s: limit on starting a worker. Raises ValueError if `fn` cannot run this way."""

    def start(self) -> None:
        """Get ready now (start workers and wait for them); the first `run` does it otherwise."""

    def run(self, completions: Sequence[str], examples: Sequence[Example], out: Outcomes) -> None:
        """Score every item: return once each index has an outcome in `out`."""

    def close(self) -> None:
        """Release what `start` / `run` hold (idempotent). RewardRunner also calls it when `run` raises, so
        results still in flight never reach a later call."""
