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

from dppo.rewards.builtin import (
    digit_fraction,
    exact_match,
    last_number_match,
    leading_number,
    math_verify_match,
    reasoning_gym_score,
)
from dppo.example import RewardFn
from dppo.runtime.plugins import is_import_path, load_object

if TYPE_CHECKING:
    from dppo.rewards.runner import RewardRunner

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number_match,
    "leading_number": leading_number,
    "digit_fraction": digit_fraction,
    "math_verify": math_verify_match,
    "reasoning_gym": reasoning_gym_score,
}

TRUSTED: tuple[RewardFn, ...] = (exact_match, last_number_match, leading_number, digit_fraction)
"""Built-ins that are pure regex/string code: RewardRunner runs them in-thread (isolation "none") by default."""

SPEC_ATTRIBUTE = "__dppo_reward_spec__"
"""Set on functions loaded from a file path, so worker processes can load them again by that path."""


def get_reward(name_or_path: str | RewardFn) -> RewardFn:
    """A reward by registry name, "module.path:function" or "path/to/file.py:function" (callables pass through).

    Raises ValueError naming the problem: unknown name (listing valid names), module or file not found,
    attribute missing (listing what the module defines), attribute not callable.
    """
    if callable(name_or_path):
        return name_or_path
    spec = name_or_path
    if spec in REWARDS:
        return REWARDS[spec]
    if not is_import_path(spec):
        raise ValueError(
            f"unknown reward {spec!r}; valid names: {', '.join(REWARDS)}, "
            "or an import path 'package.module:function' / 'path/to/file.py:function'"
        )
    fn, file_path = load_object(spec, kind="reward")
    attr = spec.rpartition(":")[2]
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    if file_path is not None:
        try:
            setattr(fn, SPEC_ATTRIBUTE, f"{file_path}:{attr}")
        except (AttributeError, TypeError):
            pass  # a callable without __dict__ stays usable with isolation "thread" / "none"
    return fn


def default_isolation(fn: RewardFn) -> str:
    """ "none" for the trusted regex built-ins, "process" for everything else."""
    return "none" if any(fn is trusted for trusted in TRUSTED) else "process"


def __getattr__(name: str) -> Any:
    # RewardRunner needs torch; reward worker processes import this package and must start without it.
    if name == "RewardRunner":
        from dppo.rewards.runner import RewardRunner

        return RewardRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REWARDS", "RewardFn", "RewardRunner", "TRUSTED", "default_isolation", "get_reward"]
