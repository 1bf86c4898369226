"""maj@k (the estimator against hand cases and the enumeration), the answers samples vote with, and `dppo eval`'s
--samples / --k / --step / --all-steps on a run with two checkpoints (eval.jsonl rows, the pass@k panel)."""

from __future__ import annotations

import json
import math

import pytest

from dppo.example import Example
from dppo.metrics import maj_at_k
from dppo.rewards import builtin
from dppo.rewards.votes import canonical, episode_text, vote_rule

A, B, C = "a", "b", "c"


def test_maj_at_k_matches_a_hand_computation():
    """Four samples, two correct votes for a and one wrong each for b and c: k=1 is the share correct (1/2); k=2 has
    6 pairs: {a,a} right, four {a,x} ties broken evenly (1/2 each), {b,c} wrong -> 3/6; k=3: {a,a,b} {a,a,c} right,
    two three-way ties (1/3 each) -> (2 + 2/3)/4; k=4: a wins."""
    votes = [[(A, 1.0), (A, 1.0), (B, 0.0), (C, 0.0)]]
    assert maj_at_k(votes, 1) == [0.5]
    assert maj_at_k(votes, 2) == [0.5]
    assert maj_at_k(votes, 3) == [pytest.approx((2 + 2 / 3) / 4, abs=1e-15)]
    assert maj_at_k(votes, 4) == [1.0]
    # three wrong votes for b outvote two right ones for a; per problem, not pooled
    assert maj_at_k([[(A, 1.0), (A, 1.0), (B, 0.0), (B, 0.0), (B, 0.0)], [(A, 1.0)] * 5], 5) == [0.0, 1.0]


def test_maj_at_k_no_vote_and_mixed_verdicts():
    """A sample without an answer casts no vote (the others decide); no vote at all is wrong; an answer whose
    samples the verifier judged differently counts with their mean."""
    assert maj_at_k([[(None, 1.0), (None, 1.0), (A, 0.0)]], 3) == [0.0]
    assert maj_at_k([[(None, 1.0), (None, 1.0), (A, 1.0)]], 3) == [1.0]
    assert maj_at_k([[(None, 1.0)] * 3], 2) == [0.0]
    assert maj_at_k([[(A, 1.0), (A, 0.0), (B, 0.0)]], 3) == [0.5]
    with pytest.raises(ValueError, match=r"^k: expected 1 <= k <= n = 3 \(samples of problem 0\), got 4"):
        maj_at_k([[(A, 1.0)] * 3], 4)


def test_sampled_maj_at_k_agrees_with_the_enumeration():
    """Past max_subsets, uniform k-subsets are drawn: the mean agrees with every-subset enumeration within 4 standard
    errors, and a fixed seed gives the same value twice."""
    votes = [[(A, 1.0)] * 5 + [(B, 0.0)] * 4 + [(C, 0.0)] * 3, [(A, 1.0)] * 3 + [(B, 0.0)] * 3 + [(None, 0.0)] * 6]
    exact = maj_at_k(votes, 6)  # C(12, 6) = 924 subsets
    sampled = maj_at_k(votes, 6, max_subsets=10, draws=4000, seed=3)
    assert sampled == maj_at_k(votes, 6, max_subsets=10, draws=4000, seed=3)
    for e, s in zip(exact, sampled):
        assert 0.05 < e < 0.95 and abs(e - s) < 4 * math.sqrt(e * (1 - e) / 4000) + 1e-9, (e, s)


def test_votes_follow_each_reward_and_canonicalise_numbers():
    ex = Example(prompt="?", answer="1250")
    assert canonical("1,250") == canonical("1250.0") == "1250" and canonical("-0.0") == "0"
    assert vote_rule(builtin.last_number_match)("so 12+34 = 1,250.", ex) == "1250"
    assert vote_rule(builtin.leading_number)("46+1", ex) == "46" and vote_rule(builtin.leading_number)("x", ex) is None
    assert vote_rule(builtin.exact_match)("  Paris\n is ", ex) == "Paris is"
    assert vote_rule(builtin.math_verify_match)(r"thus \boxed{\frac{1}{ 2}}", ex) == r"\frac{1}{2}"
    assert vote_rule(builtin.math_verify_match)("<answer>46.0</answer>", ex) == "46"
    assert vote_rule(builtin.digit_fraction) is None  # a shaped reward: nothing to vote on
    rg = Example(prompt="?", answer="x", metadata={"answer_format": "expression"})
    assert vote_rule(builtin.reasoning_gym_score)("Answer: 94*4 - 61 = 315", rg) == "94*4 - 61"

    def mine(completion, example):
        return 0.0

    assert vote_rule(mine)("The answer is <answer> 7 </answer>", ex) == "7"  # by the example's answer format
    mine.vote_answer = lambda completion, example: completion[:1]
    assert vote_rule(mine)("xyz", ex) == "x"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "41"},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "42"}]
    assert episode_text("transcript", msgs) == "42" and episode_text("just this", []) == "just this"


def test_eval_command_evaluates_each_checkpoint_with_pass_and_maj_at_k(tmp_path, capsys):
    from test_trainer import REWARD_SRC

    from dppo.cli import main
    from dppo.train.plot import checkpoint_curves, read_eval

    (tmp_path / "r.py").write_text(REWARD_SRC)
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--task.reward", f"{tmp_path / 'r.py'}:digit_fraction",
                 "--train.steps", "2", "--train.checkpoint-every", "1", "--train.keep-checkpoints", "3",
                 "--train.no-eval-before", "--log.no-progress", "--log.report-to", "none"]) == 0
    capsys.readouterr()
    trainer_rows = read_eval(run)
    assert trainer_rows and all("maj@1" in r and "by" not in r for r in trainer_rows)  # the trainer's own eval votes too
    assert main(["eval", "--run-dir", str(run), "--all-steps", "--k", "1,2"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["step"] for r in out] == [1, 2] and [r["source"][-11:] for r in out] == ["step_000001", "step_000002"]
    for r in out:
        assert r["samples_per_prompt"] == 2 and r["n"] == 2 * 16  # --samples defaults to the largest k
        assert {"pass@1", "pass@2", "maj@1", "maj@2"} <= set(r) and r["pass@1"] <= r["pass@2"] <= 1.0
        assert 0.0 <= r["maj@2"] <= 1.0 and r["maj@1"] <= r["pass@1"]  # a sample without a vote counts as wrong
    rows = read_eval(run)
    assert rows[:len(trainer_rows)] == trainer_rows and [r["by"] for r in rows[len(trainer_rows):]] == ["dppo eval"] * 2
    curves = checkpoint_curves(rows)
    assert list(curves) == ["maj@1", "maj@2", "pass@1", "pass@2"] and [s for s, _ in curves["pass@2"]] == [1, 2]
    assert main(["eval", "--run-dir", str(run), "--step", "1", "--samples", "3"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["step"] == 1 and one["samples_per_prompt"] == 3 and "pass@3" in one and "maj@3" in one
    assert main(["plot", str(run), "--out", str(tmp_path / "k.png")]) == 0
    assert (tmp_path / "k.png").stat().st_size > 1000
    for argv, message in ((["--step", "7"], f"--step: run {run} has no complete checkpoint of step 7 (it has: 1, 2)"),
                          (["--k", "3", "--samples", "2"], "--k: 3 is more than --samples 2"),
                          (["--k", "one"], "--k: expected comma-separated integers"),
                          (["--step", "1", "--all-steps"], "--step: give either --step N or --all-steps")):
        assert main(["eval", "--run-dir", str(run), *argv]) == 2
        assert message in " ".join(capsys.readouterr().err.split())
    assert main(["eval", "--preset", "smoke", "--step", "1"]) == 2
    assert "--step: evaluating a checkpoint needs --run-dir" in capsys.readouterr().err


def test_dppo_trains_closing_eval_lines_name_the_failed_episodes_as_the_steps_eval_line_does():
    """The step's eval line said "3 failures (scored 0)"; `dppo train`'s closing "eval after:" line left them out."""
    from dppo.cli import eval_summary
    from dppo.train.evaluation import eval_line

    after = {"pass@1": 0.25, "reward_mean": 0.25, "n": 8, "episode_failures": 3, "episode_timeouts": 1}
    lines = eval_summary({"eval_before": {"pass@1": 0.5, "reward_mean": 0.5, "n": 8}, "eval_after": after})
    assert lines == ["[dppo] eval before: pass@1 0.500 (mean reward 0.500, n=8)",
                     "[dppo] eval after: pass@1 0.250 (mean reward 0.250, n=8, 3 failures (scored 0), 1 timeouts (scored 0))"]
    assert eval_line(4, after).endswith("over 8 held-out samples, 3 failures (scored 0), 1 timeouts (scored 0)")
