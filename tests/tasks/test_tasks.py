"""Tasks: every built-in builds, splits are disjoint and seeded, the scorers accept the gold answers, and user
files load with errors that name the file, the line and the column."""

from __future__ import annotations

import json
import re

import pytest

from dppo.rewards import REWARDS
from dppo.tasks import TASKS, Example, Task, make_task, split_distinct
from dppo.tasks.base import prompt_text

# Small options per built-in task (countdown takes ~30 ms per question; the file task has its own tests).
SMALL = {
    "chain_sum": dict(size=30, eval_size=10),
    "basic_arithmetic": dict(size=30, eval_size=10),
    "countdown": dict(size=4, eval_size=2),
    "gsm_symbolic": dict(size=20, eval_size=5),
    "addition": dict(size=50, eval_size=20),
    "reverse": dict(size=50, eval_size=20),
    "rg:gcd": dict(size=20, eval_size=5),
    "rg:word_sorting": dict(size=10, eval_size=3),
}  # (a verifiers taskset's tasks are its episode kind's: tests/episodes/test_verifiers.py)


def question(example: Example) -> str:
    """The question without the instruction suffix (reasoning-gym), else the prompt text."""
    entry = example.metadata.get("entry")
    return entry["question"] if entry else prompt_text(example.prompt)


@pytest.fixture(scope="module")
def built() -> dict[str, Task]:
    return {name: make_task(name, **options) for name, options in SMALL.items()}


def test_small_options_cover_every_builtin_task():
    assert set(TASKS) - {"file"} <= set(SMALL)


@pytest.mark.parametrize("name", list(SMALL))
def test_task_builds_with_disjoint_nonempty_splits(built, name):
    task = built[name]
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == SMALL[name]["size"] and len(evals) == SMALL[name]["eval_size"]
    for ex in train + evals:
        assert ex.prompt and ex.answer and ex.uid
        if not isinstance(ex.prompt, str):
            assert ex.prompt[-1]["role"] == "user" and ex.prompt[-1]["content"].strip()
    assert len({ex.uid for ex in train}) == len(train)
    assert not {ex.uid for ex in train} & {ex.uid for ex in evals}
    assert not {question(ex) for ex in train} & {question(ex) for ex in evals}


@pytest.mark.parametrize("name", ["chain_sum", "addition", "reverse"])
def test_task_is_deterministic_under_the_seed(name):
    a, b = make_task(name, **SMALL[name], seed=3), make_task(name, **SMALL[name], seed=3)
    assert [ex.uid for ex in a.train + a.eval] == [ex.uid for ex in b.train + b.eval]
    assert [ex.prompt for ex in a.train] == [ex.prompt for ex in b.train]
    c = make_task(name, **SMALL[name], seed=4)
    assert [ex.uid for ex in c.eval] != [ex.uid for ex in a.eval]


def test_eval_set_does_not_depend_on_train_size():
    small = make_task("chain_sum", size=10, eval_size=10)
    large = make_task("chain_sum", size=40, eval_size=10)
    assert [ex.uid for ex in small.eval] == [ex.uid for ex in large.eval]


@pytest.mark.parametrize("name", [n for n in SMALL if n not in ("addition", "reverse")])
def test_reasoning_gym_scorer_accepts_gold_answers(built, name):
    task = built[name]
    assert task.reward is REWARDS["reasoning_gym"]
    wrap = "<answer>{}</answer>" if task.train[0].metadata["answer_format"] == "text" else "{}"
    for ex in task.train + task.eval:
        assert task.reward(wrap.format(ex.answer), ex) == 1.0, (ex.uid, ex.answer)
        assert task.reward("", ex) < 1.0


def test_small_question_space_splits_disjointly_and_refuses_too_large_eval():
    config = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    task = make_task("chain_sum", size=1000, eval_size=100, **config)
    questions = {question(ex) for ex in task.train + task.eval}
    assert len(task.eval) == 100 and len(task.train) == 100 and len(questions) == 200  # 10 x 10 x {+, -}
    with pytest.raises(ValueError, match=r"eval_size=150 leaves only 50 distinct training questions"):
        make_task("chain_sum", size=1000, eval_size=150, **config)
    with pytest.raises(ValueError, match=r"eval_size=300 but only 200 distinct"):
        make_task("chain_sum", size=10, eval_size=300, **config)


def test_prompt_has_system_prompt_and_instruction():
    task = make_task("chain_sum", size=3, eval_size=1, system_prompt="Be brief.")
    system, user = task.train[0].prompt
    assert system == {"role": "system", "content": "Be brief."}
    assert user["content"].endswith("\nAnswer with just the number.")
    assert user["content"].startswith(task.train[0].metadata["entry"]["question"])
    custom = make_task("countdown", size=1, eval_size=1, instruction=" Go.")
    assert custom.train[0].prompt[-1]["content"].endswith(" Go.")
    default = make_task("countdown", size=1, eval_size=0).train[0].prompt[-1]["content"]
    assert default.endswith("\nAnswer with just the expression.")


def test_option_and_name_errors():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['min_term'\].*'min_terms'"):
        make_task("chain_sum", min_term=2)
    with pytest.raises(ValueError, match=r"max_terms must be >= min_terms"):
        make_task("chain_sum", size=2, eval_size=1, min_terms=3, max_terms=2)
    with pytest.raises(ValueError, match=r"unknown task 'nope'; valid names: chain_sum.*addition.*rg:<"):
        make_task("nope")
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'nope'; valid names: .*chain_sum"):
        make_task("rg:nope")
    with pytest.raises(ValueError, match=r"task 'addition': unknown option\(s\) \['digit'\]"):
        make_task("addition", digit=3)


def test_reward_option_replaces_the_default():
    task = make_task("addition", size=5, eval_size=1, reward="exact_match")
    assert task.reward is REWARDS["exact_match"]


def test_addition_prompts_use_the_tiny_alphabet():
    task = make_task("addition", digits=3, size=200, eval_size=50, seed=1)
    for ex in task.train + task.eval:
        assert re.fullmatch(r"\d{1,3}\+\d{1,3}=", ex.prompt)
        a, b = map(int, ex.prompt[:-1].split("+"))
        assert ex.answer == str(a + b)
        assert task.reward(ex.answer, ex) == 1.0 and task.reward(ex.answer + "=", ex) == 1.0
        assert task.reward(str(a + b + 1), ex) == 0.0
    assert max(int(ex.metadata["a"]) for ex in task.train) >= 100  # 3-digit operands occur


def test_reverse_prompts_answers_lengths_and_vocabulary():
    from dppo.runtime.models import char_tokenizer

    tok = char_tokenizer()
    task = make_task("reverse", size=200, eval_size=50, seed=1)  # defaults: 16..20 characters
    assert task.name == "reverse" and task.reward is REWARDS["leading_number"]
    lengths = set()
    for ex in task.train + task.eval:
        m = re.fullmatch(r"reverse:(\d{16,20})=", ex.prompt)
        assert m, ex.prompt
        assert ex.answer == m.group(1)[::-1] == ex.metadata["s"][::-1] and ex.uid == f"reverse:{m.group(1)}"
        lengths.add(len(ex.answer))
        assert tok.unk_token_id not in tok.encode(ex.prompt + ex.answer, add_special_tokens=False)
        assert len(tok.encode(ex.answer, add_special_tokens=False)) == len(ex.answer) >= 16  # one token per digit
    assert lengths == set(range(16, 21))  # both bounds reached
    assert any(ex.answer.startswith("0") for ex in task.train)  # leading zeros occur (the reward must keep them)
    assert not {ex.prompt for ex in task.train} & {ex.prompt for ex in task.eval}
    short = make_task("reverse", min_len=3, max_len=3, size=20, eval_size=5, seed=2)
    assert {len(ex.answer) for ex in short.train + short.eval} == {3}


def test_reverse_reward_is_exact_on_the_leading_digits():
    task = make_task("reverse", min_len=16, max_len=16, size=5, eval_size=1)
    ex = Example(prompt="reverse:1234567890123400=", answer="0043210987654321")
    assert task.reward("0043210987654321", ex) == 1.0
    assert task.reward("0043210987654321=reverse", ex) == 1.0  # stops at the first non-digit
    assert task.reward("043210987654321", ex) == 0.0  # a dropped leading zero is wrong (strings, not ints)
    assert task.reward("00432109876543210", ex) == 0.0  # one digit too many
    assert task.reward("0043210987654320", ex) == 0.0  # last digit wrong
    assert task.reward(" 0043210987654321", ex) == 0.0 and task.reward("", ex) == 0.0
    for gold in task.train + task.eval:
        assert task.reward(gold.answer, gold) == 1.0 and task.reward(gold.answer[:-1], gold) == 0.0
        if gold.metadata["s"] != gold.answer:  # the unreversed string (unless a palindrome) is wrong
            assert task.reward(gold.metadata["s"], gold) == 0.0


def test_reverse_option_errors_name_the_option():
    with pytest.raises(ValueError, match=r"reverse: min_len must be >= 1, got 0"):
        make_task("reverse", min_len=0, max_len=4, size=5, eval_size=1)
    with pytest.raises(ValueError, match=r"reverse: max_len must be >= min_len \(16\), got 15"):
        make_task("reverse", max_len=15, size=5, eval_size=1)
    with pytest.raises(ValueError, match=r"reverse: size must be >= 1"):
        make_task("reverse", size=0, eval_size=1)
    with pytest.raises(ValueError, match=r"reverse: eval_size=20 but only 10 distinct"):
        make_task("reverse", min_len=1, max_len=1, size=5, eval_size=20)  # 10 one-digit strings
    with pytest.raises(ValueError, match=r"task 'reverse': unknown option\(s\) \['length'\]"):
        make_task("reverse", length=16)


def test_split_distinct_dedupes_and_orders():
    stream = [Example(prompt=p, answer="") for p in "aabbcdde"]
    train, evals = split_distinct(stream, size=2, eval_size=2, task="t")
    assert [ex.prompt for ex in evals] == ["a", "b"] and [ex.prompt for ex in train] == ["c", "d"]


# -- user files ------------------------------------------------------------------------------------------

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(20)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_file_task(task: Task, n: int = 20) -> None:
    assert len(task.train) + len(task.eval) == n and len(task.eval) == 2  # default eval_fraction 0.1
    assert not {ex.uid for ex in task.train} & {ex.uid for ex in task.eval}
    ex = task.train[0]
    assert ex.prompt[-1]["role"] == "user" and ex.prompt[-1]["content"].startswith("What is")
    assert ex.answer == str(2 * int(ex.prompt[-1]["content"].split()[2]))
    assert task.reward is REWARDS["math_verify"]


def test_file_task_jsonl_parquet_csv_and_folder(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_file_task(make_task("file", path=str(write_jsonl(tmp_path / "d.jsonl", ROWS))))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    check_file_task(make_task("file", path=str(tmp_path / "d.parquet")))
    lines = "".join(f'"{r["prompt"]}",{r["answer"]}\n' for r in ROWS)
    (tmp_path / "d.csv").write_text("prompt,answer\n" + lines)
    check_file_task(make_task("file", path=str(tmp_path / "d.csv")))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "folder"))
    check_file_task(make_task("file", path=str(tmp_path / "folder")))


def test_file_task_chat_prompts_system_prompt_and_metadata(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "gold": i, "level": 1} for i in range(5)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    task = make_task("file", path=str(path), prompt_column="messages", answer_column="gold",
                     system_prompt="Think.", eval_fraction=0.0)
    assert len(task.train) == 5 and not task.eval
    ex = task.train[0]
    assert ex.prompt == ({"role": "system", "content": "Think."}, {"role": "user", "content": "q0"})
    assert ex.answer == "0" and ex.metadata["level"] == 1
    raw_path = str(write_jsonl(tmp_path / "raw.jsonl", ROWS))
    raw = make_task("file", path=raw_path, chat=False, eval_fraction=0.0)
    assert raw.train[0].prompt == "What is 0 + 0?"


def test_file_task_split_is_seeded_and_eval_path_is_disjoint(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS + ROWS[:5]))  # duplicates are dropped
    a, b = (make_task("file", path=path, eval_fraction=0.25, seed=1) for _ in range(2))
    assert len(a.train) == 15 and len(a.eval) == 5
    assert [ex.uid for ex in a.eval] == [ex.uid for ex in b.eval]
    eval_path = str(write_jsonl(tmp_path / "e.jsonl", ROWS[:3]))
    c = make_task("file", path=path, eval_path=eval_path)
    assert len(c.eval) == 3 and len(c.train) == 17
    assert not {ex.uid for ex in c.train} & {ex.uid for ex in c.eval}


def test_file_task_errors_name_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "x", "answer": \n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}: line 3: malformed JSON"):
        make_task("file", path=str(bad))
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    present = r"columns present: \['answer', 'level', 'prompt'\]"
    with pytest.raises(ValueError, match=rf"d.jsonl: line 1: missing column 'question'; {present}"):
        make_task("file", path=path, prompt_column="question")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: the dataset is empty"):
        make_task("file", path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match=r"data file not found"):
        make_task("file", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"not both"):
        make_task("file", path=path, eval_path=path, eval_fraction=0.1)
