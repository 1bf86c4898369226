"""The built-in rewards: `fn(completion, example) -> float`, pure, module-level (so worker processes can
import them by reference).

- `exact_match`: the whole completion equals the answer after whitespace normalisation.
- `last_number_match`: the last number in the completion equals the (numeric) answer.
- `digit_fraction`: the fraction of digit characters (a shaped reward for the smoke preset).
- `leading_number`: the digits at the start of the completion equal the answer (the tiny `addition` task).
- `math_verify_match`: math-verify's `parse` / `verify` (\\boxed{}, LaTeX, plain expressions, the last
  number); the content of an <answer> tag is used when present.
- `reasoning_gym_score`: the reasoning-gym dataset's own `score_answer` on the extracted answer (see
  `dppo.rewards.extract.extract_answer`); may give partial credit (e.g. countdown's 0.05 for a wrong value).

math-verify and reasoning-gym are imported on first use, so importing this module stays cheap; the rewards
that need them list them in `worker_imports`, which RewardRunner imports before timing the first call.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dppo.rewards.extract import answer_tag, extract_answer, last_number, numbers_equal

if TYPE_CHECKING:
    from dppo.example import Example


def exact_match(completion: str, example: Example) -> float:
    """1.0 if the completion equals the answer, ignoring leading/trailing whitespace and runs of whitespace.

    >>> from dppo.tasks import Example
    >>> ex = Example(prompt="Capital of France?", answer="Paris")
    >>> exact_match("  Paris\\n", ex), exact_match("paris", ex), exact_match("It is Paris", ex)
    (1.0, 0.0, 0.0)
    """
    return float(" ".join(completion.split()) == " ".join(example.answer.split()))


def last_number_match(completion: str, example: Example) -> float:
    """1.0 if the last number in the completion equals the answer as a number ("46" == "46.0" == "46,").

    >>> from dppo.tasks import Example
    >>> ex = Example(prompt="What is 12+34?", answer="46")
    >>> last_number_match("12 + 34 = 46.", ex), last_number_match("47", ex), last_number_match("none", ex)
    (1.0, 0.0, 0.0)
    """
    number = last_number(completion)
    return float(number is not None and numbers_equal(number, example.answer))


def digit_fraction(completion: str, example: Example) -> float:
    """The fraction of the completion's characters that are digits (0 for an empty completion).

    A shaped reward with signal even for a random character-level model: the `smoke` preset uses it so that
    every step has nonzero advantages and gradients. Not a correctness reward.

    >>> from dppo.tasks import Example
    >>> ex = Example(prompt="1+2=", answer="3")
    >>> digit_fraction("3", ex), digit_fraction("3a", ex), digit_fraction("", ex)
    (1.0, 0.5, 0.0)
    """
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


def leading_number(completion: str, example: Example) -> float:
    """1.0 if the digits at the start of the completion (up to the first non-digit or the end) equal the answer.

    >>> from dppo.tasks import Example
    >>> ex = Example(prompt="12+34=", answer="46")
    >>> leading_number("46", ex), leading_number("46+1=", ex), leading_number("466", ex), leading_number(" 46", ex)
    (1.0, 1.0, 0.0, 0.0)
    """
    digits = ""
    for ch in completion:
        if not ch.isascii() or not ch.isdigit():
            break
        digits += ch
    return float(digits != "" and digits == example.answer)


def math_verify_match(completion: str, example: Example) -> float:
    """1.0 if math-verify finds the completion's answer equal to the gold answer (a number, LaTeX or an
    expression). Uses the last <answer> tag's content when present. math-verify's own signal-based time
    limits apply only in the main thread (elsewhere they cannot run; RewardRunner bounds the call instead).
    Raises ValueError when the gold answer cannot be parsed (counted as a failure by RewardRunner).
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(example.answer, parsing_timeout=timeout) or parse(f"${example.answer}$", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the gold answer {example.answer!r} of example {example.uid}")
    tagged = answer_tag(completion)
    pred = parse(completion if tagged is None else tagged, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


math_verify_match.worker_imports = ("math_verify",)


_SCORERS: dict[tuple[str, str], Callable[[str | None, dict], float]] = {}


def _scorer(dataset: str, config: dict[str, Any]) -> Callable[[str | None, dict], float]:
    """The `score_answer` of a reasoning-gym dataset built with `config` (cached per process)."""
    key = (dataset, json.dumps(config, sort_keys=True, default=repr))
    if key not in _SCORERS:
        import reasoning_gym

        _SCORERS[key] = reasoning_gym.create_dataset(dataset, size=1, seed=0, **config).score_answer
    return _SCORERS[key]


def reasoning_gym_score(completion: str, example: Example) -> float:
    """The reasoning-gym scorer of the example's dataset applied to the answer extracted from the completion.

    Reads from `example.metadata`: "entry" (the reasoning-gym entry), "rg_dataset" and "rg_config" (default:
    the entry's source dataset with its default config) and "answer_format" (default "text").
    """
    entry = example.metadata["entry"]
    dataset = example.metadata.get("rg_dataset") or entry["metadata"]["source_dataset"]
    config = example.metadata.get("rg_config") or {}
    answer = extract_answer(completion, example.metadata.get("answer_format", "text"))
    return float(_scorer(dataset, config)(answer, entry))


reasoning_gym_score.worker_imports = ("reasoning_gym",)
