"""The calculator task two ways, side by side from one warm start: dppo's `calculator` environment, and the same loop
written as an OpenAI-client agent (`dppo.episodes.examples.calculator:solve`) trained through the recording proxy.

    1. `dppo sft --preset calculator --out DIR` (the environment's demonstrations; both runs start from it);
    2. `dppo train --preset calculator --model.name DIR` (the environment);
    3. `dppo train --preset calculator_agent --model.name DIR` (the agent, through the proxy);

each with evaluation before and after (held-out pass@1, same questions, same seeds). Checks: the agent's pass@1
after RL is within `TOLERANCE` of the environment's and rises over its warm start by `MARGIN`. Prints a table, then
one JSON line (docs/agents.md "Bring your own agent" quotes it).

    nice .venv/bin/python benchmarks/bench_agent_learning.py --precision fp32 --eval-samples 2   # ~19 min, 2 Zen 4 cores
    nice .venv/bin/python benchmarks/bench_agent_learning.py --steps 1 --eval-size 2 --sft-steps 1   # ~6 min
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import emit, train_arm  # benchmarks/ is on sys.path when a benchmark runs as a script

MARGIN = 0.25
"""The agent's pass@1 after RL must beat its warm start's by this much."""
TOLERANCE = 0.25
"""... and be within this of the environment's (16 questions: one question is 0.0625)."""


def run_arm(preset: str, sft: Path, out: Path, args) -> dict:
    from dppo.train.config import replace
    from dppo.train.presets import get_preset

    train = {"eval_before": True, "eval_samples_per_prompt": args.eval_samples,
             **({"steps": args.steps} if args.steps else {})}
    model = {"name": str(sft), **({"precision": args.precision} if args.precision else {})}
    cfg = replace(get_preset(preset), model=model, train=train, task={"eval_size": args.eval_size},
                  log={"report_to": ("none",), "progress": False, "run_dir": str(out)})
    return train_arm(cfg, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval-size", type=int, default=16, help="held-out questions (the preset's first N)")
    p.add_argument("--steps", type=int, default=0, help="RL steps (default: the preset's, 12)")
    p.add_argument("--eval-samples", type=int, default=1, help="samples per held-out question")
    p.add_argument("--precision", default="", help="the trainer's model.precision (default: the preset's, auto)")
    p.add_argument("--sft-steps", type=int, default=3, help="warm-start steps (default 3, as `dppo sft`)")
    p.add_argument("--out", default=None, help="folder for the warm start and the runs (default: a temp dir)")
    args = p.parse_args()

    from dppo.cli import main as dppo

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-agent-"))
    sft = out / "calc-sft"
    t0 = time.perf_counter()
    if dppo(["sft", "--preset", "calculator", "--out", str(sft), "--steps", str(args.sft_steps), "--log-every", "0"]):
        raise SystemExit("dppo sft failed")
    t_sft = time.perf_counter() - t0
    arms = {name: run_arm(preset, sft, out / name, args)
            for name, preset in (("environment", "calculator"), ("agent", "calculator_agent"))}

    print(f"\ncalculator (chain_sum, 4-5 terms of 3 digits; {args.eval_size} held-out questions x {args.eval_samples}, "
          f"temperature 1; trainer precision {args.precision or 'auto'}), "
          f"from one warm start ({args.sft_steps} sft steps, {t_sft:.0f} s)")
    print(f"{'':<34}{'pass@1 before':>14}{'after':>8}{'tool calls':>12}{'step s':>8}{'gen s':>8}")
    for name, label in (("environment", "`calculator` environment"), ("agent", "openai-client agent, proxy")):
        a = arms[name]
        print(f"{label:<34}{a['before']['pass@1']:>14.3f}{a['after']['pass@1']:>8.3f}"
              f"{a['after'].get('tool_calls', float('nan')):>12.2f}{a['step_s']:>8.1f}{a['generation_s']:>8.1f}")
        print(f"  training reward per step: {a['training_reward']}")
    env, agent = arms["environment"]["after"]["pass@1"], arms["agent"]["after"]["pass@1"]
    checks = {"agent_learns": agent >= arms["agent"]["before"]["pass@1"] + MARGIN,
              "agent_like_environment": abs(agent - env) <= TOLERANCE}
    emit({"benchmark": "agent_learning", "eval_size": args.eval_size, "eval_samples": args.eval_samples,
          "precision": args.precision or "auto", "sft_steps": args.sft_steps,
          "sft_s": t_sft, "arms": arms, "checks": checks})


if __name__ == "__main__":
    main()
