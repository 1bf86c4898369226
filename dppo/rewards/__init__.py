"""Rewards: plain functions `fn(completion: str, example: Example) -> float`.

A reward gets the decoded completion (the response text only, without the prompt) and the `Example` it
answers (`example.answer` is the gold answer, `example.metadata` whatever the task stored for scoring). It
returns a finite float (1.0 / 0.0 for right / wrong; partial credit allowed), is pure (no state, no
logging), and may raise: `RewardRunner` turns an exception or a timeout into reward 0.0 and counts it, and
rejects NaN/inf with a ValueError naming the reward.

Built-ins (`REWARDS`): exact_match, last_number, leading_number, digit_fraction, math_verify, reasoning_gym (see
`dppo.rewards.builtin`). Custom rewards by import path: `get_reward("mypkg.rewards:fn")` or
`get_reward("path/to/file.py:fn")`.

    runner = RewardRunner(get_reward("math_verify"), timeout_s=10.0)
    rewards, stats = runner(completions, examples)   # float32 [B]; {"failures": int, "timeouts": int}

Isolation (`RewardRunner(isolation=...)`): "process" (default for math_verify, reasoning_gym and every
custom reward: a pool of worker processes; a call past its timeout gets its worker killed and replaced),
"thread" (daemon threads; a timed-out call is abandoned, not stopped), "none" (in the calling thread, no
timeout; default for the trusted string built-ins exact_match, last_number, leading_number, digit_fraction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dppo.example import RewardFn
from dppo.rewards.registry import REWARDS, TRUSTED, default_isolation, get_reward

if TYPE_CHECKING:
    from dppo.rewards.runner import RewardRunner


def __getattr__(name: str) -> Any:
    # RewardRunner needs torch; reward worker processes import this package and must start without it.
    if name == "RewardRunner":
        from dppo.rewards.runner import RewardRunner

        return RewardRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REWARDS", "RewardFn", "RewardRunner", "TRUSTED", "default_isolation", "get_reward"]
