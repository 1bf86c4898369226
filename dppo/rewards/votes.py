"""The answer a sample votes for in maj@k (`dppo.metrics.maj_at_k`): the part of a completion its reward compares
with the reference, in a canonical form, so that "46", "46.0" and "1,250" / "1250" count as one answer.

Per built-in reward (`VOTE_RULES`, keyed by the reward function):
- last_number:    the last number (`last_number`), as a canonical decimal;
- leading_number: the digits at the start of the completion;
- exact_match:    the completion with runs of whitespace collapsed;
- math_verify:    the last <answer> tag's content, else the last \\boxed{}, else the last number — canonical when a
                  number, else with whitespace removed (equivalent LaTeX forms that are not the same string are
                  different votes: a vote is a string, not a math-verify equivalence class);
- reasoning_gym:  `extract_answer` by the example's answer format, canonical when a number;
- digit_fraction: none (a shaped reward, not a verdict: maj@k is not reported).
Any other reward (an import path): `extract_answer` by the example's "answer_format" metadata (default "text"),
canonical when a number. A function may set its own rule as an attribute: `fn.vote_answer = rule`,
rule(completion, example) -> str | None. None = the sample casts no vote.

Pure string functions; the text voted on is the completion of a single answer, or the last assistant message of a
multi-turn episode (`episode_text`).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Callable

from dppo.rewards.extract import answer_tag, boxed, extract_answer, last_number
from dppo.rewards.registry import REWARDS

if TYPE_CHECKING:
    from dppo.example import Example, RewardFn

VoteRule = Callable[[str, "Example"], "str | None"]

__all__ = ["VOTE_RULES", "canonical", "episode_text", "vote_rule"]


def canonical(answer: str | None) -> str | None:
    """A number string as a canonical decimal ("46.0" -> "46", "1,250" -> "1250", "-0" -> "0"), anything else
    stripped; None or an empty answer -> None.

    >>> canonical("46.0"), canonical(" 1,250 "), canonical("x + 1"), canonical("  ")
    ('46', '1250', 'x + 1', None)
    """
    if answer is None or not answer.strip():
        return None
    text = answer.strip()
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    value = value.normalize()
    return format(value if value != 0 else Decimal(0), "f")


def _last_number(completion: str, example: Example) -> str | None:
    return canonical(last_number(completion))


def _leading_digits(completion: str, example: Example) -> str | None:
    digits = ""
    for ch in completion:
        if not ch.isascii() or not ch.isdigit():
            break
        digits += ch
    return digits or None


def _whitespace(completion: str, example: Example) -> str | None:
    return " ".join(completion.split()) or None


def _math(completion: str, example: Example) -> str | None:
    found = answer_tag(completion)
    found = boxed(completion) if found is None else found
    found = last_number(completion) if found is None else found
    found = canonical(found)
    if found is None:
        return None
    try:
        Decimal(found)
        return found
    except InvalidOperation:
        return "".join(found.split())


def _by_format(completion: str, example: Example) -> str | None:
    return canonical(extract_answer(completion, example.metadata.get("answer_format", "text")))


VOTE_RULES: dict[Callable, VoteRule | None] = {
    REWARDS["last_number"]: _last_number,
    REWARDS["leading_number"]: _leading_digits,
    REWARDS["exact_match"]: _whitespace,
    REWARDS["math_verify"]: _math,
    REWARDS["reasoning_gym"]: _by_format,
    REWARDS["digit_fraction"]: None,
}


def vote_rule(reward: RewardFn) -> VoteRule | None:
    """The rule that gives a sample's vote under `reward` (module docstring); None = the reward has no answer to vote
    on (maj@k is not reported)."""
    own = getattr(reward, "vote_answer", None)
    if callable(own):
        return own
    return VOTE_RULES.get(reward, _by_format)


def episode_text(completion: str, messages: list[dict]) -> str:
    """The text a sample votes with: a multi-turn episode's last assistant message, else the completion."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return completion
