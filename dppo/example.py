"""The types tasks and rewards share: a question (`Example`), its prompt, and the reward signature.

An `Example` is one question: the prompt the rollout engine sees, the gold answer, whatever the scorer needs
(`metadata`) and a stable `uid`. A reward is `fn(completion, example) -> float` (`RewardFn`). Tasks
(`dppo.tasks`) make examples and name a default reward; rewards (`dppo.rewards`) score them; both import this
module and neither imports the other's types.

This module imports nothing heavy: reward worker processes unpickle `Example`s and import it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
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
