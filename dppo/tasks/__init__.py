"""Verifiable tasks: questions with gold answers, a held-out split, and a default reward.

    task = make_task("chain_sum", size=1000, eval_size=100, min_terms=2, max_terms=2, max_digits=1)
    train, evals = task.train_examples(), task.eval_examples()   # list[Example], disjoint by uid
    rewards, stats = RewardRunner(task.reward)(completions, examples)

Built-in names (`TASKS`): chain_sum, basic_arithmetic, countdown, gsm_symbolic (reasoning-gym, see
`dppo.tasks.rg`), addition (a tiny raw-text a+b task for a character-level model, `dppo.tasks.addition`),
reverse (reverse a 16-20 digit string: >= 16-token answers for the same model, `dppo.tasks.reverse`),
file (user data, `dppo.tasks.files`). (A verifiers v1 taskset's tasks are supplied by its episode kind,
`dppo.episodes.verifiers`.) Any reasoning-gym dataset is available as "rg:<name>", with its config options as keyword options. `make_task(..., reward=<name or import path>)` replaces the default
reward (see `dppo.rewards.get_reward`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dppo.rewards import get_reward
from dppo.tasks.addition import addition
from dppo.tasks.base import Example, Prompt, RewardFn, Task, split_distinct
from dppo.tasks.files import file_task
from dppo.tasks.reverse import reverse
from dppo.tasks.rg import basic_arithmetic, chain_sum, countdown, gsm_symbolic, reasoning_gym_task

TASKS: dict[str, Callable[..., Task]] = {
    "chain_sum": chain_sum,
    "basic_arithmetic": basic_arithmetic,
    "countdown": countdown,
    "gsm_symbolic": gsm_symbolic,
    "addition": addition,
    "reverse": reverse,
    "file": file_task,
}

RG_PREFIX = "rg:"


def _check_options(name: str, builder: Callable[..., Task], options: dict[str, Any]) -> None:
    params = inspect.signature(builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the builder validates its own (dataset) options
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"task {name!r}: unknown option(s) {unknown}; accepted: {list(params)}")


def make_task(name: str, **options: Any) -> Task:
    """Build task `name` ("chain_sum", "rg:gcd", "file", ...) with its options.

    `reward` (optional): a reward name or import path replacing the task's default reward.
    """
    reward = options.pop("reward", None)
    if name.startswith(RG_PREFIX):
        task = reasoning_gym_task(name[len(RG_PREFIX) :], **options)
    elif name in TASKS:
        _check_options(name, TASKS[name], options)
        task = TASKS[name](**options)
    else:
        valid = ", ".join(TASKS)
        raise ValueError(f"unknown task {name!r}; valid names: {valid}, or {RG_PREFIX}<reasoning-gym dataset>")
    if reward is not None:
        task = Task(name=task.name, train=task.train, eval=task.eval, reward=get_reward(reward))
    return task


__all__ = ["Example", "Prompt", "RewardFn", "TASKS", "Task", "make_task", "split_distinct"]
