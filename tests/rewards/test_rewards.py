"""Rewards: each built-in on hand-written completions, import-path plugins, and RewardRunner's containment
(exceptions, a reward that never returns, a crashing worker, NaN) in every isolation mode."""

from __future__ import annotations

import doctest
import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dppo.rewards.builtin
import dppo.rewards.extract
import dppo.example
from dppo.rewards import REWARDS, RewardRunner, default_isolation, get_reward
from dppo.rewards.extract import boxed, extract_answer, last_number
from dppo.rewards.runner import ISOLATION
from dppo.tasks import Example, make_task


@pytest.mark.parametrize("module", [dppo.rewards.builtin, dppo.rewards.extract, dppo.example])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


NUM = Example(prompt="What is 40 + 6?", answer="46")
CASES = [  # completion, exact_match, last_number, math_verify
    ("46", 1.0, 1.0, 1.0),
    ("  46\n", 1.0, 1.0, 1.0),
    ("40 + 6 = 46.", 0.0, 1.0, 1.0),
    ("The answer is \\boxed{46}.", 0.0, 1.0, 1.0),
    ("<answer>46</answer>", 0.0, 1.0, 1.0),
    ("46.0", 0.0, 1.0, 1.0),
    ("47", 0.0, 0.0, 0.0),
    ("The answer is 46, no wait, 47", 0.0, 0.0, 1.0),  # math-verify prefers the "answer is" anchor
    ("46 apples, or 47", 0.0, 0.0, 0.0),
    ("garbage", 0.0, 0.0, 0.0),
    ("", 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("completion,exact,last,mv", CASES)
def test_builtin_rewards_on_handwritten_completions(completion, exact, last, mv):
    assert REWARDS["exact_match"](completion, NUM) == exact
    assert REWARDS["last_number"](completion, NUM) == last
    assert REWARDS["math_verify"](completion, NUM) == mv


def test_math_verify_handles_latex_gold_and_fractions():
    half = Example(prompt="?", answer="\\frac{1}{2}")
    assert REWARDS["math_verify"]("so $\\boxed{0.5}$", half) == 1.0
    assert REWARDS["math_verify"]("1/3", half) == 0.0
    assert REWARDS["math_verify"]("x = \\frac{2}{4}", Example(prompt="?", answer="0.5")) == 1.0


def test_leading_number():
    ex = Example(prompt="12+34=", answer="46")
    assert [REWARDS["leading_number"](c, ex) for c in ["46", "46<eos>", "4", "466", "x46", ""]] == [1, 1, 0, 0, 0, 0]


def test_reasoning_gym_reward_extracts_by_answer_format():
    chain = make_task("chain_sum", size=2, eval_size=0).train[0]
    score = REWARDS["reasoning_gym"]
    assert score(f"Sure! The result is {chain.answer}.", chain) == 1.0
    assert score(f"\\boxed{{{chain.answer}}}", chain) == 1.0
    assert score("I don't know", chain) == 0.0
    countdown = make_task("countdown", size=1, eval_size=0).train[0]
    target = countdown.metadata["entry"]["metadata"]["target"]
    assert score(f"Answer: {countdown.answer} = {target}", countdown) == 1.0
    assert score("1 + 1", countdown) < 1.0


def test_extraction_helpers():
    assert boxed("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_number("from -3 to 4-1") == "1" and last_number("x = -4") == "-4"
    assert last_number("1,234,567.5 units") == "1234567.5" and last_number("\u22127") == "-7"
    assert extract_answer("<answer> 3 apples </answer> 9", "number") == "3"
    assert extract_answer("`1 + 2*3`", "expression") == "1 + 2*3"
    with pytest.raises(ValueError, match="unknown answer format"):
        extract_answer("x", "json")


@given(st.integers(-(10**9), 10**9), st.text(alphabet="abc xyz=:,.!?\n", max_size=20))
def test_last_number_finds_a_trailing_integer(n, prefix):
    ex = Example(prompt="?", answer=str(n))
    assert REWARDS["last_number"](f"{prefix} {n}", ex) == 1.0
    assert REWARDS["last_number"](f"{prefix} {n + 1}", ex) == 0.0


# -- custom rewards by import path -----------------------------------------------------------------------

PLUGIN = '''
import math, os, time

def mixed(completion, example):
    """Behaviour chosen by the completion: raise, hang, crash, nan, str; else its length."""
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "hang":
        while True:
            time.sleep(60)
    if completion == "crash":
        os._exit(3)
    if completion == "nan":
        return math.nan
    if completion == "str":
        return "not a number"
    return float(len(completion))

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "dppo_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "dppo_test_plugin.py"


def test_get_reward_by_name_module_and_file(plugin):
    assert get_reward("math_verify") is REWARDS["math_verify"]
    assert get_reward("dppo_test_plugin:mixed")("abc", NUM) == 3.0
    assert get_reward(f"{plugin}:mixed")("abcd", NUM) == 4.0
    assert default_isolation(get_reward("exact_match")) == "none"
    assert default_isolation(get_reward("dppo_test_plugin:mixed")) == "process"


def test_get_reward_errors(plugin):
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; valid names: exact_match, .*math_verify"):
        get_reward("nope")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'; it defines \['mixed'\]"):
        get_reward("dppo_test_plugin:missing")
    with pytest.raises(ValueError, match=r"'NOT_CALLABLE' is a int, not a callable"):
        get_reward(f"{plugin}:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"file not found"):
        get_reward(f"{plugin.parent}/nope.py:fn")


# -- RewardRunner ----------------------------------------------------------------------------------------

BATCH = ["ab", "raise", "str", "abcd", "x" * 7]
EXPECTED = [2.0, 0.0, 0.0, 4.0, 7.0]


@pytest.mark.parametrize("isolation", ["none", "thread", "process"])
def test_runner_counts_failures_and_matches_direct_calls(plugin, isolation):
    examples = [NUM] * len(BATCH)
    with RewardRunner(f"{plugin}:mixed", isolation=isolation, workers=2, timeout_s=5.0) as runner:
        for _ in range(2):  # the second call reuses the worker pool
            rewards, stats = runner(BATCH, examples)
            assert rewards.dtype == torch.float32 and rewards.shape == (len(BATCH),)
            assert rewards.tolist() == EXPECTED
            assert stats == {"failures": 2, "timeouts": 0}
            assert any("RuntimeError: boom" in e for e in runner.last_errors)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_runner_bounds_a_reward_that_never_returns(plugin, isolation):
    completions = ["ab", "hang", "abc", "hang", "abcd", "a"]
    with RewardRunner("dppo_test_plugin:mixed", isolation=isolation, workers=2, timeout_s=1.0) as runner:
        runner.start()  # start the workers outside the timed call
        start = time.monotonic()
        rewards, stats = runner(completions, [NUM] * len(completions))
        elapsed = time.monotonic() - start
        assert rewards.tolist() == [2.0, 0.0, 3.0, 0.0, 4.0, 1.0]
        assert stats == {"failures": 0, "timeouts": 2}
        # Two 1 s timeouts, possibly one after the other, plus worker restarts on a busy 2-core machine.
        assert elapsed < 15.0
        assert runner(["abc"], [NUM])[0].tolist() == [3.0]  # still usable


MIXED = [("ab", 2.0), ("raise", 0.0), ("str", 0.0), ("hang", 0.0), ("abcd", 4.0), ("hang", 0.0), ("a", 1.0)]
"""(completion, reward): good, raising, non-number and never-returning ("hang") calls, interleaved."""
NO_TIMEOUT = {"none"}
"""Isolations that run the reward in the calling thread with no limit: a "hang" item would never return, so
the shared test leaves those items out there (the rest of the batch is still checked)."""


@pytest.mark.parametrize("isolation", list(ISOLATION))
def test_every_isolation_gives_the_same_rewards_and_counts(plugin, isolation):
    batch = [(c, r) for c, r in MIXED if not (isolation in NO_TIMEOUT and c == "hang")]
    completions = [c for c, _ in batch]
    hangs = completions.count("hang")
    with RewardRunner("dppo_test_plugin:mixed", isolation=isolation, workers=2, timeout_s=1.0) as runner:
        runner.start()
        rewards, stats = runner(completions, [NUM] * len(completions))
        assert rewards.tolist() == [r for _, r in batch]
        assert stats == {"failures": 2, "timeouts": hangs}
        assert sum("timed out after 1 s" in e for e in runner.last_errors) == hangs
        assert sum("RuntimeError: boom" in e for e in runner.last_errors) == 1
        assert sum("ValueError: could not convert string to float" in e for e in runner.last_errors) == 1


def test_process_runner_survives_a_crashing_worker(plugin):
    with RewardRunner(f"{plugin}:mixed", isolation="process", workers=1, timeout_s=5.0) as runner:
        rewards, stats = runner(["ab", "crash", "abc"], [NUM] * 3)
        assert rewards.tolist() == [2.0, 0.0, 3.0]
        assert stats == {"failures": 1, "timeouts": 0}
        assert "exit code 3" in runner.last_errors[0]


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_non_finite_reward_is_rejected_naming_it(plugin, isolation):
    with RewardRunner("dppo_test_plugin:mixed", isolation=isolation, workers=1, task="toy") as runner:
        with pytest.raises(ValueError, match=r"reward 'dppo_test_plugin:mixed' \(task 'toy'\) returned nan"):
            runner(["ab", "nan"], [NUM, NUM])


def test_runner_argument_errors(plugin):
    with pytest.raises(ValueError, match=r"cannot be sent to a worker process"):
        RewardRunner(lambda c, e: 1.0, isolation="process")
    assert RewardRunner(lambda c, e: 1.0, isolation="thread")(["a"], [NUM])[0].tolist() == [1.0]
    with pytest.raises(ValueError, match=r"isolation must be one of"):
        RewardRunner("exact_match", isolation="container")
    with pytest.raises(ValueError, match=r"2 completions for 1 examples"):
        RewardRunner("exact_match")(["a", "b"], [NUM])


def test_worker_that_cannot_load_the_reward_raises(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("def fn(c, e):\n    return 1.0\n")
    fn = get_reward(f"{path}:fn")
    path.unlink()  # the worker loads the file again by path
    for first_use in (RewardRunner.start, lambda runner: runner(["a"], [NUM])):
        with RewardRunner(fn, isolation="process", workers=1) as runner:
            with pytest.raises(RuntimeError, match=r"(?s)could not load reward '.*gone.py:fn'.*file not found"):
                first_use(runner)


def test_default_isolation_per_builtin():
    assert RewardRunner("last_number").isolation == "none"
    assert RewardRunner("math_verify").isolation == "process"
    rewards, stats = RewardRunner("last_number")(["46", "x"], [NUM, NUM])
    assert rewards.tolist() == [1.0, 0.0] and stats == {"failures": 0, "timeouts": 0}
    assert math.isclose(RewardRunner("math_verify", isolation="thread")(["\\boxed{46}"], [NUM])[0].item(), 1.0)
