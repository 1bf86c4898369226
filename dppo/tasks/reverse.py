"""The built-in long-answer tiny task: "reverse:<s>=" -> s reversed, for a character-level model.

What it is for: the miniature stability study (`dppo sanity --task reverse`) with responses of >= 16 tokens. The
training–inference mismatch term of the paper's bound grows with the response length T, and the `addition` task's
answers are only 1-3 characters; reversing a digit string of length `min_len`..`max_len` (default 16..20) gives
answers of that many characters (+ EOS) from the same character vocabulary (digits, letters, ':' and '=').

Prompts are raw strings (no chat template), e.g. "reverse:0123456789012345=" with answer "5432109876543210"; `s`
is uniform over digit strings (leading zeros allowed) with a length uniform in [min_len, max_len]. The reward is
`leading_number` (exact match, no partial credit): the digits at the start of the completion, up to the first
non-digit or the end, compared *as a string* with the answer, so leading zeros count and a too-long or too-short
digit run scores 0. Questions are drawn from a seeded stream and split with `split_distinct`, so train and eval
share no string.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from dppo.rewards.builtin import leading_number
from dppo.tasks.base import Example, Task, split_distinct

PREFIX = "reverse:"


def _questions(min_len: int, max_len: int, seed: int) -> Iterator[Example]:
    rng = random.Random(seed)
    while True:
        s = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        yield Example(prompt=f"{PREFIX}{s}=", answer=s[::-1], metadata={"s": s}, uid=f"reverse:{s}")


def reverse(*, min_len: int = 16, max_len: int = 20, size: int = 5000, eval_size: int = 500, seed: int = 0) -> Task:
    """Reverse a digit string of `min_len`..`max_len` characters; `size` / `eval_size` distinct train / held-out
    questions."""
    if min_len < 1:
        raise ValueError(f"reverse: min_len must be >= 1, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"reverse: max_len must be >= min_len ({min_len}), got {max_len}")
    train, eval_ = split_distinct(_questions(min_len, max_len, seed), size=size, eval_size=eval_size, task="reverse")
    return Task(name="reverse", train=train, eval=eval_, reward=leading_number)
