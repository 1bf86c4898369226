"""A task's type, and the one split rule every task uses.

A `Task` holds a training list, a held-out evaluation list of `dppo.example.Example`s and the default reward
for the task (the shared types `Example`, `Prompt`, `RewardFn` live in `dppo.example` and are re-exported here).

Held-out means disjoint by question: `split_distinct` de-duplicates a (seeded, deterministic) stream of
candidate examples by uid, gives the first `eval_size` distinct questions to evaluation and the next `size`
distinct ones to training. The evaluation set therefore does not depend on `size` (the same seed gives the
same eval questions whatever the training size), and small question spaces (chain_sum with two one-digit
terms has 200 questions) are handled by taking what exists and refusing only when training would be left
smaller than both `size` and the evaluation set.

"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dppo.example import Example, Message, Prompt, RewardFn, prompt_text, text_uid

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


__all__ = ["Example", "Message", "Prompt", "RewardFn", "Task", "chat_prompt", "prompt_text", "split_distinct", "text_uid"]
