"""Tasks from reasoning-gym: procedural questions with their own scorers, fully offline.

`reasoning_gym_task(dataset, ...)` works for any reasoning-gym dataset name (`make_task("rg:<name>", ...)`);
`chain_sum`, `basic_arithmetic`, `countdown` and `gsm_symbolic` are the same with per-dataset defaults.

Prompt: an optional system message, then the user message = the dataset's question + `instruction`. The
default instruction depends on the answer format, which the reward uses to extract the answer from a
completion (see `dppo.rewards.extract.extract_answer`):

- "number" (chain_sum, basic_arithmetic, gsm_symbolic, and any dataset whose gold answers are all numbers):
  "\\nAnswer with just the number."; the scorer sees the last number of the completion.
- "expression" (countdown): "\\nAnswer with just the expression."; the scorer sees the last non-empty line,
  without a trailing "= target".
- "text" (everything else): "\\nGive your final answer inside <answer></answer> tags."; the scorer sees
  the stripped completion.
In every format the content of the last <answer>...</answer>, else of the last \\boxed{...}, is used first.

Every other option is passed to the dataset's config (e.g. chain_sum's min_terms, max_terms, min_digits,
max_digits, allow_negation); unknown names are refused with the list the dataset accepts. The split is
`split_distinct` over the dataset's entries in index order (entry i is generated from seed + i, so the eval
set does not change with `size`). Generation cost varies: countdown takes ~30 ms per question.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from dppo.rewards.builtin import reasoning_gym_score
from dppo.tasks.base import Example, Task, chat_prompt, split_distinct, text_uid

ANSWER_FORMATS = ("number", "expression", "text")

DEFAULT_INSTRUCTIONS = {
    "number": "\nAnswer with just the number.",
    "expression": "\nAnswer with just the expression.",
    "text": "\nGive your final answer inside <answer></answer> tags.",
}

KNOWN_FORMATS = {
    "chain_sum": "number",
    "basic_arithmetic": "number",
    "gsm_symbolic": "number",
    "countdown": "expression",
}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def dataset_config_fields(dataset: str) -> list[str]:
    """The config options a reasoning-gym dataset accepts (without seed and size, which the task sets)."""
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        valid = ", ".join(sorted(DATASETS))
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; valid names: {valid}")
    _, config_cls = DATASETS[dataset]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def _entries(task: str, dataset: str, config: dict[str, Any], seed: int, count: int) -> Iterator[dict]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(dataset, size=count, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as err:
        raise ValueError(f"{task}: invalid config {config}: {err}") from err
    for i in range(count):
        yield ds[i]


def reasoning_gym_task(
    dataset: str,
    *,
    size: int = 1000,
    eval_size: int = 100,
    seed: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = None,
    answer_format: str | None = None,
    config: dict[str, Any] | None = None,
    name: str | None = None,
    **dataset_options: Any,
) -> Task:
    """A task over reasoning-gym dataset `dataset`, scored by the dataset's own `score_answer`.

    size / eval_size: distinct training / held-out questions (training gets fewer when the question space
    is smaller; see `split_distinct`). seed: the dataset seed. instruction: appended to each question (None:
    the answer format's default). answer_format: "number" | "expression" | "text" (None: the dataset's
    known format, else "number" when every generated gold answer is a number, else "text").
    config / **dataset_options: the dataset's own configuration (merged; keyword options win).
    """
    task = name or f"rg:{dataset}"
    accepted = dataset_config_fields(dataset)
    dataset_config = {**(config or {}), **dataset_options}
    unknown = sorted(set(dataset_config) - set(accepted))
    if unknown:
        raise ValueError(f"{task}: unknown option(s) {unknown}; the dataset accepts {accepted}")
    if answer_format is not None and answer_format not in ANSWER_FORMATS:
        raise ValueError(f"{task}: answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")

    # Enough draws for small question spaces (split_distinct also stops after a run of duplicates).
    count = 4 * (size + eval_size) + 1000
    entries = _entries(task, dataset, dataset_config, seed, count)
    candidates = (
        Example(e["question"], str(e["answer"]), metadata={"entry": e}, uid=text_uid(dataset, e["question"]))
        for e in entries
    )
    train, eval_ = split_distinct(candidates, size=size, eval_size=eval_size, task=task)

    fmt = answer_format or KNOWN_FORMATS.get(dataset)
    if fmt is None:
        all_numbers = all(_NUMBER.fullmatch(ex.answer.strip()) for ex in train + eval_)
        fmt = "number" if all_numbers else "text"
    suffix = DEFAULT_INSTRUCTIONS[fmt] if instruction is None else instruction

    def finish(ex: Example) -> Example:
        metadata = {
            "entry": ex.metadata["entry"],
            "rg_dataset": dataset,
            "rg_config": dataset_config,
            "answer_format": fmt,
        }
        prompt = chat_prompt(ex.prompt + suffix, system_prompt)
        return Example(prompt=prompt, answer=ex.answer, metadata=metadata, uid=ex.uid)

    return Task(
        name=task,
        train=tuple(map(finish, train)),
        eval=tuple(map(finish, eval_)),
        reward=reasoning_gym_score,
    )


def chain_sum(**options: Any) -> Task:
    """reasoning-gym chain_sum ("4 - 1 - 7 ="); options: min_terms, max_terms, min_digits, max_digits,
    allow_negation, plus the common task options."""
    return reasoning_gym_task("chain_sum", name="chain_sum", **options)


def basic_arithmetic(**options: Any) -> Task:
    """reasoning-gym basic_arithmetic ("Calculate ( 56 + -33 ) - 84."); options: min_terms, max_terms,
    min_digits, max_digits, operators, allow_parentheses, allow_negation, format_style, whitespace."""
    return reasoning_gym_task("basic_arithmetic", name="basic_arithmetic", **options)


def countdown(**options: Any) -> Task:
    """reasoning-gym countdown (reach a target with the given numbers; answer is an expression); options:
    min_numbers, max_numbers, min_value, max_value, min_target, max_target, operators, shuffle."""
    return reasoning_gym_task("countdown", name="countdown", **options)


def gsm_symbolic(**options: Any) -> Task:
    """reasoning-gym gsm_symbolic (GSM8K-style word problems with fresh numbers); option: difficulty."""
    return reasoning_gym_task("gsm_symbolic", name="gsm_symbolic", **options)
