"""User data as a task: JSONL, JSON, Parquet, CSV, or a folder written by `datasets.save_to_disk`.

Each row gives a prompt (`prompt_column`: a string, or a list of {"role", "content"} chat messages) and a
gold answer (`answer_column`, turned into a string; None for rewards that need none). The whole row is the
example's metadata, so a custom reward can read any column. A string prompt becomes a user message after an
optional system prompt, with `instruction` appended; `chat=False` keeps it raw text (no chat template).

Held-out evaluation: a separate `eval_path` (training then drops any question also in it), or a seeded
`eval_fraction` of the distinct questions (default 0.1), or, for a DatasetDict folder, its "test" or
"validation" split. Rows are de-duplicated by question (an `id_column`, else the prompt text).

Errors name the file: a malformed JSONL line (with its line number), a missing column (with the columns
present), an empty file.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

from dppo.rewards.builtin import math_verify_match
from dppo.tasks.base import Example, Task, chat_prompt, prompt_text, text_uid

Row = dict[str, Any]


def _read_jsonl(path: Path) -> list[tuple[str, Row]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {lineno}: malformed JSON: {err.msg}") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"line {lineno}", row))
    return rows


def _read_json(path: Path) -> list[tuple[str, Row]]:
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return _read_jsonl(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno}: malformed JSON: {err.msg}") from err
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: item {i}: expected a JSON object, got {type(row).__name__}")
    return [(f"item {i}", row) for i, row in enumerate(data)]


def _read_csv(path: Path) -> list[tuple[str, Row]]:
    with path.open(encoding="utf-8", newline="") as f:
        # Line numbers count the header as line 1; values stay strings.
        return [(f"line {i}", dict(row)) for i, row in enumerate(csv.DictReader(f), start=2)]


def _read_parquet(path: Path) -> list[tuple[str, Row]]:
    import pyarrow.parquet as pq

    return [(f"row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def _read_folder(path: Path, split: str) -> tuple[list[tuple[str, Row]], list[tuple[str, Row]] | None]:
    """A `save_to_disk` folder: (rows of `split`, rows of its test/validation split or None)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.Dataset):
        return [(f"row {i}", row) for i, row in enumerate(loaded)], None
    if split not in loaded:
        raise ValueError(f"{path}: no split {split!r}; the folder has {sorted(loaded)}")
    held_out = next((s for s in ("test", "validation") if s in loaded and s != split), None)
    rows = [(f"{split} row {i}", row) for i, row in enumerate(loaded[split])]
    eval_rows = [(f"{held_out} row {i}", r) for i, r in enumerate(loaded[held_out])] if held_out else None
    return rows, eval_rows


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def read_rows(path: str | Path, *, split: str = "train") -> tuple[list[tuple[str, Row]], list[tuple[str, Row]] | None]:
    """(rows, held-out rows or None) of a data file or folder; each row comes with where it is (for errors)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file not found: {path}")
    if path.is_dir():
        rows, held_out = _read_folder(path, split)
    elif path.suffix.lower() in READERS:
        rows, held_out = READERS[path.suffix.lower()](path), None
    else:
        raise ValueError(f"{path}: unknown format; expected one of {sorted(READERS)} or a save_to_disk folder")
    if not rows:
        raise ValueError(f"{path}: the dataset is empty (no rows)")
    return rows, held_out


def _prompt(value: Any, where: str, *, chat: bool, system_prompt: str | None, instruction: str):
    if isinstance(value, str):
        return chat_prompt(value + instruction, system_prompt) if chat else value + instruction
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        messages = []
        for m in value:
            if not {"role", "content"} <= set(m):
                raise ValueError(f"{where}: each chat message needs 'role' and 'content', got keys {sorted(m)}")
            messages.append({"role": str(m["role"]), "content": str(m["content"])})
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tuple(messages)
    raise ValueError(f"{where}: the prompt must be a string or a non-empty list of chat messages, got {value!r:.80}")


def rows_to_examples(
    rows: list[tuple[str, Row]],
    path: str | Path,
    *,
    prompt_column: str,
    answer_column: str | None,
    id_column: str | None,
    system_prompt: str | None,
    instruction: str,
    chat: bool,
) -> list[Example]:
    """Examples from rows, de-duplicated by uid (first occurrence kept)."""
    examples: dict[str, Example] = {}
    for where_in_file, row in rows:
        where = f"{path}: {where_in_file}"
        for column in (prompt_column, answer_column, id_column):
            if column is not None and column not in row:
                raise ValueError(f"{where}: missing column {column!r}; columns present: {sorted(row)}")
        answer = row[answer_column] if answer_column is not None else ""
        if answer is None:
            raise ValueError(f"{where}: column {answer_column!r} is empty")
        prompt = _prompt(row[prompt_column], where, chat=chat, system_prompt=system_prompt, instruction=instruction)
        uid = f"id:{row[id_column]}" if id_column is not None else text_uid("file", prompt_text(prompt))
        examples.setdefault(uid, Example(prompt=prompt, answer=str(answer), metadata=dict(row), uid=uid))
    return list(examples.values())


def file_task(
    path: str,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    id_column: str | None = None,
    system_prompt: str | None = None,
    instruction: str = "",
    chat: bool = True,
    eval_path: str | None = None,
    eval_fraction: float | None = None,
    split: str = "train",
    seed: int = 0,
) -> Task:
    """A task from a data file or folder (see the module docstring); default reward `math_verify`.

    eval_fraction (default 0.1 when there is no eval_path and no held-out split) of the distinct questions is
    held out by a seeded draw; it may not be combined with eval_path.
    """
    if eval_path is not None and eval_fraction is not None:
        raise ValueError("file task: give eval_path or eval_fraction, not both")
    if eval_fraction is not None and not 0 <= eval_fraction < 1:
        raise ValueError(f"file task: eval_fraction must be in [0, 1), got {eval_fraction}")
    columns = dict(prompt_column=prompt_column, answer_column=answer_column, id_column=id_column)
    formatting = dict(system_prompt=system_prompt, instruction=instruction, chat=chat)
    rows, held_out = read_rows(path, split=split)
    examples = rows_to_examples(rows, path, **columns, **formatting)

    if eval_path is not None or (held_out is not None and eval_fraction is None):
        source = eval_path if eval_path is not None else path
        eval_rows = read_rows(eval_path)[0] if eval_path is not None else held_out
        eval_examples = rows_to_examples(eval_rows, source, **columns, **formatting)
        held_uids = {ex.uid for ex in eval_examples}
        train = [ex for ex in examples if ex.uid not in held_uids]
    else:
        fraction = 0.1 if eval_fraction is None else eval_fraction
        n_eval = round(len(examples) * fraction)
        if fraction > 0 and len(examples) >= 2:
            n_eval = max(n_eval, 1)
        held = set(random.Random(seed).sample(range(len(examples)), n_eval))
        eval_examples = [ex for i, ex in enumerate(examples) if i in held]
        train = [ex for i, ex in enumerate(examples) if i not in held]
    if not train:
        raise ValueError(f"{path}: no training questions left after holding out {len(eval_examples)} for eval")
    return Task(name="file", train=tuple(train), eval=tuple(eval_examples), reward=math_verify_match)
