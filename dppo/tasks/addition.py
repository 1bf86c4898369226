"""The built-in tiny task: "a+b=" -> "c", for a character-level model (vocabulary: digits, '+', '=').

Prompts are raw strings (no chat template), e.g. "12+34=" with answer "46"; operands are uniform in
[0, 10**digits), without leading zeros. The reward (`leading_number`) compares the digits at the start of
the completion, up to the first non-digit or the end, with the answer. Questions are drawn from a seeded
stream and split with `split_distinct`, so train and eval share no "a+b" pair. With digits=2 there are
10,000 questions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from dppo.rewards.builtin import leading_number
from dppo.tasks.base import Example, Task, split_distinct


def _questions(digits: int, seed: int) -> Iterator[Example]:
    rng = random.Random(seed)
    high = 10**digits
    while True:
        a, b = rng.randrange(high), rng.randrange(high)
        yield Example(prompt=f"{a}+{b}=", answer=str(a + b), metadata={"a": a, "b": b}, uid=f"addition:{a}+{b}")


def addition(*, digits: int = 2, size: int = 5000, eval_size: int = 500, seed: int = 0) -> Task:
    """a+b with operands of up to `digits` digits; `size` / `eval_size` distinct train / held-out questions."""
    if digits < 1:
        raise ValueError(f"addition: digits must be >= 1, got {digits}")
    train, eval_ = split_distinct(_questions(digits, seed), size=size, eval_size=eval_size, task="addition")
    return Task(name="addition", train=train, eval=eval_, reward=leading_number)
