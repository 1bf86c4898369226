"""RewardRunner: score a batch of completions with a per-call timeout, exception capture and isolation.

A reward that raises, returns a non-number, crashes its worker, or runs past `timeout_s` gives 0.0 for that
completion and is counted (`failures`: raised / non-number / worker died; `timeouts`: past the limit).
A NaN or infinite reward is a bug, not a miss: it raises NonFiniteRewardError (a ValueError) naming the
reward (and task).

Where the reward runs is the isolation, one `Strategy` (dppo.rewards.strategy) per entry of `ISOLATION`:
- "process" (dppo.rewards.processes): a persistent pool of worker processes; a call past the limit gets its
  worker killed (SIGKILL) and replaced. The reward must be importable by the worker (not a lambda).
- "thread" (dppo.rewards.threads): daemon threads; a timed-out call is abandoned (it keeps running but its
  result is dropped) and its thread replaced. Cheap, but a reward that never returns keeps a CPU busy.
- "none" (dppo.rewards.inline): in the calling thread, no timeout (for trusted built-ins: pure string code).
Default (`isolation=None`): `dppo.rewards.default_isolation` ("none" for exact_match / last_number /
leading_number / digit_fraction, "process" for everything else). The runner itself only checks arguments,
hands the batch to its strategy, and turns the outcomes into the rewards tensor and the stats.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from dppo.example import Example, RewardFn
from dppo.rewards.registry import SPEC_ATTRIBUTE, default_isolation, get_reward
from dppo.rewards.inline import InlineStrategy
from dppo.rewards.processes import ProcessStrategy
from dppo.rewards.strategy import Outcomes, Strategy
from dppo.rewards.threads import ThreadStrategy

ISOLATION: dict[str, type[Strategy]] = {
    "none": InlineStrategy,
    "thread": ThreadStrategy,
    "process": ProcessStrategy,
}


class NonFiniteRewardError(ValueError):
    """A reward returned NaN or ±inf: a bug in the reward, not a wrong answer. The message names the reward,
    the task and the example. The trainer skips the step's update (weights untouched) and counts it."""


class RewardRunner:
    """Scores (completion, example) pairs: `runner(completions, examples) -> (rewards [B] float32, stats)`.

    stats = {"failures": int, "timeouts": int} for this call; `last_errors` keeps up to 8 messages of the
    last call, `last_status` each item's outcome ("ok", "failure", "timeout"). Worker processes start on the
    first call (or `start()`) and are reused; `close()` (or leaving a `with` block, garbage collection,
    interpreter exit) stops them, and a worker exits by itself within a second when this process dies.
    """

    def __init__(
        self,
        fn: RewardFn | str,
        *,
        timeout_s: float = 10.0,
        workers: int | None = None,
        isolation: str | None = None,
        name: str | None = None,
        task: str | None = None,
        startup_timeout_s: float = 120.0,
    ):
        """fn: a reward or a name/import path (`get_reward`). timeout_s: limit per call (per completion).
        workers: processes/threads (default min(4, CPU count)). isolation: "process" | "thread" | "none"
        (None: `default_isolation(fn)`). name / task: used in error messages. startup_timeout_s: limit on a
        worker's start (interpreter start plus importing the reward's module), not counted in timeout_s.
        """
        self.fn = get_reward(fn)
        default_name = getattr(self.fn, SPEC_ATTRIBUTE, None) or getattr(self.fn, "__qualname__", repr(self.fn))
        self.name = name or (fn if isinstance(fn, str) else default_name)
        self.task = task
        self.isolation = isolation or default_isolation(self.fn)
        if self.isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {tuple(ISOLATION)}, got {self.isolation!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.workers = workers or min(4, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.startup_timeout_s = startup_timeout_s
        self.last_errors: list[str] = []
        self.last_status: list[str] = []
        self._strategy: Strategy = ISOLATION[self.isolation](
            self.fn, name=self.name, timeout_s=self.timeout_s, workers=self.workers,
            startup_timeout_s=self.startup_timeout_s,
        )

    def __call__(self, completions: Sequence[str], examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, int]]:
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions for {len(examples)} examples")
        out = Outcomes(examples, self.timeout_s)
        try:
            self._strategy.run(completions, examples, out)
        except BaseException:  # e.g. Ctrl-C mid-call: results still in flight must not reach a later call
            self.close()
            raise
        self.last_errors, self.last_status = out.errors, out.status
        self._check_finite(out.values, completions, examples)
        rewards = torch.tensor(out.values, dtype=torch.float32)
        return rewards, {"failures": out.failures, "timeouts": out.timeouts}

    def start(self) -> None:
        """Start the worker processes now and wait until they have loaded the reward (raises RuntimeError if
        one cannot). Optional: the first call starts them otherwise. No-op for isolation "thread" / "none"."""
        self._strategy.start()

    def close(self) -> None:
        self._strategy.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_finite(self, values, completions, examples) -> None:
        for value, completion, example in zip(values, completions, examples):
            if not math.isfinite(value):
                where = f" (task {self.task!r})" if self.task else ""
                raise NonFiniteRewardError(
                    f"reward {self.name!r}{where} returned {value} for example {example.uid!r} "
                    f"(completion {completion[:80]!r}); non-finite rewards are rejected"
                )
