"""The reward registry: the built-ins by name (`REWARDS`), the trusted ones that run in-thread (`TRUSTED`), and
`get_reward`, which resolves a name or an import path ("module:function", "path/to/file.py:function") to a
function. Below the runner and the worker (both import it), free of torch: reward worker processes import it."""

from __future__ import annotations

from dppo.example import RewardFn
from dppo.rewards.builtin import (
    digit_fraction,
    exact_match,
    last_number_match,
    leading_number,
    math_verify_match,
    reasoning_gym_score,
)
from dppo.runtime.plugins import is_import_path, load_object

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
