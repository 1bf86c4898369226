"""Isolation "none": the reward runs in the calling thread, one item after another, with no timeout.

For trusted built-ins (pure string code such as exact_match or last_number), where starting threads or
processes costs more than the calls. A reward that never returns blocks the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

from dppo.example import Example, RewardFn
from dppo.rewards.strategy import Outcomes
from dppo.rewards.worker import score_item, warm_up


class InlineStrategy:
    """Calls the reward directly; `timeout_s`, `workers` and `startup_timeout_s` do not apply."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, workers: int, startup_timeout_s: float):
        self.fn = fn
        warm_up(fn)

    def start(self) -> None:
        pass

    def run(self, completions: Sequence[str], examples: Sequence[Example], out: Outcomes) -> None:
        for i, (completion, example) in enumerate(zip(completions, examples)):
            out.result(i, *score_item(self.fn, completion, example))

    def close(self) -> None:
        pass
