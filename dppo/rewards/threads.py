"""Isolation "thread": the reward runs in `workers` daemon threads; a call past the limit is abandoned.

The calls go through `dppo.runtime.bounded.bounded_calls`: an abandoned call keeps running (Python cannot stop a
thread) but its result is dropped and its slot goes to the next item, so the batch finishes on time. Cheap and
works for any callable (lambdas, closures), but a reward that never returns keeps a CPU busy until the process
exits.
"""

from __future__ import annotations

from collections.abc import Sequence

from dppo.example import Example, RewardFn
from dppo.rewards.strategy import Outcomes
from dppo.rewards.worker import score_item, warm_up
from dppo.runtime.bounded import bounded_calls


class ThreadStrategy:
    """At most `workers` daemon threads at a time per call, one per item (`bounded_calls`)."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, workers: int, startup_timeout_s: float):
        self.fn = fn
        self.timeout_s = timeout_s
        self.workers = workers
        warm_up(fn)

    def start(self) -> None:
        pass

    def run(self, completions: Sequence[str], examples: Sequence[Example], out: Outcomes) -> None:
        calls = [lambda i=i: score_item(self.fn, completions[i], examples[i]) for i in range(len(examples))]
        for i, outcome in enumerate(bounded_calls(calls, self.timeout_s, workers=self.workers, name="dppo-reward")):
            if outcome.status == "timeout":
                out.timeout(i)
            elif outcome.status == "error":  # (score_item catches the reward's own exceptions)
                out.result(i, None, f"{type(outcome.error).__name__}: {outcome.error}")
            else:
                out.result(i, *outcome.value)

    def close(self) -> None:
        pass
