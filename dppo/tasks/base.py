"""The types every task returns, and the one split rule every task uses.

An `Example` is one question: the prompt the rollout engine sees, the gold answer, whatever the scorer needs
(`metadata`) and a stable `uid`. A `Task` holds a training list, a held-out evaluation list and the default
reward for the task.

Held-out means disjoint by question: `split_distinct` de-duplicates a (seeded, deterministic) stream of
candidate examples by uid, gives the first `eval_size` distinct questions to evaluation and the next `size`
distinct ones to training. The evaluation set therefore does not depend on `size` (the same seed gives the
same eval questions whatever the training size), and small question spaces (chain_sum with two one-digit
terms has 200 questions) are handled by taking what exists and refusing only when training would be left
smaller than both `size` and the evaluation set.

This module imports nothing heavy: reward worker processes unpickle `Example`s and import it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]
"""A chat message: {"role": "system" | "user" | "assistant", "content": str}."""

Prompt = str | tuple[Message, ...]
"""Chat messages (the engine applies the tokenizer's chat template) or a raw string (tokenised as is)."""


def prompt_text(prompt: Prompt) -> str:
    """A canonical string for a prompt: the raw text, or the messages as sorted-key JSON."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(list(prompt), sort_keys=True, ensure_ascii=False)


def text_uid(namespace: str, text: str) -> str:
    """A stable id for a question text: `namespace:` + 16 hex digits of its SHA-1."""
    return f"{namespace}:{hashlib.sha1(text.encode('utf-8')).hexdigest()[:16]}"


@dataclass(frozen=True)
class Example:
    """One verifiable question.

    >>> Example(prompt="12+34=", answer="46").uid
    'prompt:e851df52c28d1d2d'
    """

    prompt: Prompt
    """Chat messages (tuple of {"role", "content"} dicts; the engine applies the chat template) or a raw
    string (tokenised without a template)."""
    answer: str
    """The gold answer as text (a bare number for numeric tasks)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Whatever the scorer needs (e.g. the reasoning-gym entry and its dataset config)."""
    uid: str = ""
    """Stable id of the question, used for de-duplication and disjoint splits. Empty: a hash of the prompt."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if not self.uid:
            object.__setattr__(self, "uid", text_uid("prompt", prompt_text(self.prompt)))


RewardFn = Callable[[str, Example], float]
"""A reward: `fn(completion, example) -> float`, pure; see `dppo.rewards`."""


@dataclass(frozen=True)
class Task:
    """A named set of training and held-out evaluation examples (disjoint by uid) plus a default reward."""

    name: str
    """The task's name as given to `make_task` (e.g. "chain_sum", "rg:gcd", "file")."""
    train: tuple[Example, ...]
    """Training examples (distinct questions)."""
    eval: tuple[Example, ...]
    """Held-out evaluation examples; no uid or question is shared with `train`."""
    reward: RewardFn
    """The task's default reward function."""

    def train_examples(self) -> list[Example]:
        return list(self.train)

    def eval_examples(self) -> list[Example]:
        return list(self.eval)


def chat_prompt(content: str, system_prompt: str | None) -> tuple[Message, ...]:
    """A one-turn chat prompt: an optional system message, then the user message."""
    messages = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    return messages + ({"role": "user", "content": content},)


def split_distinct(
    candidates: Iterable[Example],
    *,
    size: int,
    eval_size: int,
    task: str,
    patience: int = 2000,
) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """Split a deterministic candidate stream into disjoint (train, eval) sets of distinct questions.

    The first `eval_size` distinct uids go to eval, the next `size` distinct uids to train. Consumption stops
    when both are full, when the stream ends, or after `patience` consecutive duplicates (the question space
    is exhausted). Raises ValueError when fewer than `eval_size` distinct questions exist, or when training
    would get fewer than min(size, eval_size) questions.
    """
    if size < 1:
        raise ValueError(f"{task}: size must be >= 1, got {size}")
    if eval_size < 0:
        raise ValueError(f"{task}: eval_size must be >= 0, got {eval_size}")
    seen: set[str] = set()
    eval_examples: list[Example] = []
    train: list[Example] = []
    duplicates_in_a_row = 0
    for example in candidates:
        if example.uid in seen:
            duplicates_in_a_row += 1
            if duplicates_in_a_row >= patience:
                break
            continue
        duplicates_in_a_row = 0
        seen.add(example.uid)
        (eval_examples if len(eval_examples) < eval_size else train).append(example)
        if len(train) >= size:
            break
    distinct = len(eval_examples) + len(train)
    if len(eval_examples) < eval_size:
        raise ValueError(
            f"{task}: eval_size={eval_size} but only {distinct} distinct questions could be generated; "
            "lower eval_size or widen the task's configuration"
        )
    if len(train) < min(size, eval_size) or not train:
        raise ValueError(
            f"{task}: eval_size={eval_size} leaves only {len(train)} distinct training questions "
            f"(of {distinct} found, {size} requested); lower eval_size or widen the task's configuration"
        )
    return tuple(train), tuple(eval_examples)
