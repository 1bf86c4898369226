"""Pulling an answer out of a completion: <answer> tags, \\boxed{}, the last number, the last line.

Pure string functions shared by the built-in rewards. `extract_answer(text, fmt)` is the rule the
reasoning-gym reward applies before calling a dataset's scorer:

1. the content of the last <answer>...</answer>, else of the last \\boxed{...}, else the whole completion;
2. then, by answer format: "number" -> the last number in it (if any); "expression" -> its last non-empty
   line, without backticks, "$", a leading "Answer:" and a trailing "= <number>"; "text" -> stripped.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# An integer or decimal, with optional thousands separators; "-" only when it cannot be a binary minus
# (so "4-1" and "(3)-1" give "1", "x = -4" gives "-4"); never inside a word or after a decimal point.
_NUMBER = re.compile(r"(?<![\w.)\]])-?\d+(?:,\d{3})*(?:\.\d+)?")
_LEADING_LABEL = re.compile(r"^\s*(?:final answer|answer|expression|result)\s*[:=]\s*", re.IGNORECASE)
_TRAILING_EQUALS = re.compile(r"\s*=\s*-?\d+(?:\.\d+)?\s*$")


def answer_tag(text: str) -> str | None:
    """The stripped content of the last <answer>...</answer>, or None.

    >>> answer_tag("<think>2+2</think><answer> 4 </answer>")
    '4'
    >>> answer_tag("4") is None
    True
    """
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or None.

    >>> boxed(r"so \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> boxed("no box") is None
    True
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None  # unbalanced


def last_number(text: str) -> str | None:
    """The last integer or decimal in `text` (thousands commas removed, "−" read as "-"), or None.

    >>> last_number("4 - 1 - 7 = -4.")
    '-4'
    >>> last_number("a total of 1,250 apples")
    '1250'
    >>> last_number("no digits") is None
    True
    """
    matches = _NUMBER.findall(text.replace("\u2212", "-"))
    return matches[-1].replace(",", "") if matches else None


def numbers_equal(a: str, b: str) -> bool:
    """Whether two number strings denote the same value ("46" == "46.0" == "+46"); False if either is not one.

    >>> numbers_equal("46", "46.00"), numbers_equal("1,000", "1000"), numbers_equal("4", "x")
    (True, True, False)
    """
    try:
        return Decimal(a.strip().replace(",", "")) == Decimal(b.strip().replace(",", ""))
    except InvalidOperation:
        return False


def _last_line_expression(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    line = line.strip().strip("`$").strip()
    line = _LEADING_LABEL.sub("", line)
    return _TRAILING_EQUALS.sub("", line).strip().rstrip(".").strip()


def extract_answer(text: str, fmt: str = "text") -> str:
    """The answer in a completion, by answer format ("number" | "expression" | "text"); see the module doc.

    >>> extract_answer("So the sum is 6.", "number")
    '6'
    >>> extract_answer("Answer: 94*4 - 61 - 6 = 309", "expression")
    '94*4 - 61 - 6'
    >>> extract_answer("blah <answer>Paris</answer>", "text")
    'Paris'
    """
    candidate = answer_tag(text)
    if candidate is None:
        candidate = boxed(text)
    if candidate is None:
        candidate = text
    if fmt == "number":
        number = last_number(candidate)
        return number if number is not None else candidate.strip()
    if fmt == "expression":
        return _last_line_expression(candidate)
    if fmt == "text":
        return candidate.strip()
    raise ValueError(f"unknown answer format {fmt!r}; expected 'number', 'expression' or 'text'")
