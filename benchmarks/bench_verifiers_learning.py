"""The demo's task two ways, side by side in one run: `dppo train --preset demo` (./run.sh), and the same questions as
a verifiers v1 taskset (benchmarks/tasksets/dppo_vf_chain_sum.py) trained through verifiers' own harness (`null`,
its chat program, on verifiers' local subprocess runtime) and client (`EvalClient`, or `TrainClient` with
`--client train`) against dppo's recording proxy.

    1. dppo:      the demo preset as is (SmolLM2-135M-Instruct, DPPO-Binary-TV, chain_sum two one-digit terms);
    2. verifiers: the demo preset with --rollout.episodes verifiers --verifiers.taskset (the taskset, its held-out
                  questions first, kept in order: --verifiers.shuffle false, the same 64 held-out and 136 training
                  questions); the taskset's @vf.reward is the demo's reward on the last reply;

same seed, same steps, evaluation before and after (held-out pass@1, 64 questions x 2 samples). Checks: the
verifiers arm's pass@1 rises by MARGIN over its start and lands within TOLERANCE of the demo's. Prints a table, then
one JSON line (docs/agents.md, "Environments from verifiers, OpenEnv and MCP", quotes it).

    nice .venv/bin/python benchmarks/bench_verifiers_learning.py                     # ~40 min, 2 Zen 4 cores
    nice .venv/bin/python benchmarks/bench_verifiers_learning.py --steps 2 --eval-size 8   # a few minutes
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import ROOT, emit, train_arm  # benchmarks/ is on sys.path when a benchmark runs as a script

MARGIN = 0.25
"""The verifiers arm's pass@1 after RL must beat its start's by this much."""
TOLERANCE = 0.2
"""... and be within this of the demo's (the demo's pass@1 after 30 steps spans 0.67-0.86 over seeds 0-2)."""
TASKSET = ROOT / "benchmarks" / "tasksets" / "dppo_vf_chain_sum.py"


def arm_config(name: str, args, out: Path):
    from dppo.train.config import replace
    from dppo.train.presets import get_preset

    train = {"eval_before": True, "seed": args.seed, **({"steps": args.steps} if args.steps else {})}
    if args.eval_samples:
        train["eval_samples_per_prompt"] = args.eval_samples
    task = {"seed": args.seed, **({"eval_size": args.eval_size} if args.eval_size else {})}
    sections = {}
    if name == "verifiers":
        # 32 harness programs at a time, each episode up to 10 min: 128 evaluation episodes started at once on 2 cores
        # (a Python process each) ran past the default 2 min and failed. The train client renders with the run's
        # model's tokenizer.
        sections = {"rollout": {"episodes": "verifiers"},
                    "verifiers": {"taskset": str(TASKSET), "options": json.dumps({"seed": args.seed}), "shuffle": False,
                                  "client": args.client},
                    "proxy": {"concurrency": args.concurrency, "timeout_s": 600.0}}
    return replace(get_preset("demo"), train=train, task=task, **sections,
                   log={"report_to": ("none",), "progress": False, "run_dir": str(out)})


def run_arm(name: str, args, out: Path) -> dict:
    return train_arm(arm_config(name, args, out), out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="RL steps (default: the demo's, 30)")
    p.add_argument("--eval-size", type=int, default=0, help="held-out questions (default: the demo's, 64)")
    p.add_argument("--eval-samples", type=int, default=0, help="samples per held-out question (default: the demo's, 2)")
    p.add_argument("--seed", type=int, default=0, help="the task's and the trainer's seed (both arms)")
    p.add_argument("--client", default="eval", choices=("eval", "train"), help="verifiers' client")
    p.add_argument("--concurrency", type=int, default=32, help="verifiers episodes at once (proxy.concurrency)")
    p.add_argument("--arms", default="dppo,verifiers", help="which arms, comma-separated")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temp dir)")
    args = p.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-verifiers-"))
    names = [a for a in args.arms.split(",") if a]
    arms = {name: run_arm(name, args, out / name) for name in names}

    print(f"\nthe demo's task (chain_sum, two one-digit terms; held-out pass@1, temperature 1), seed {args.seed}, "
          f"verifiers client {args.client}")
    print(f"{'':<40}{'pass@1 before':>14}{'after':>8}{'step s':>8}{'gen s':>8}{'wall s':>8}")
    labels = {"dppo": "dppo demo (./run.sh)", "verifiers": "verifiers taskset, harness, client"}
    for name, a in arms.items():
        print(f"{labels[name]:<40}{a['before']['pass@1']:>14.3f}{a['after']['pass@1']:>8.3f}{a['step_s']:>8.1f}"
              f"{a['generation_s']:>8.1f}{a['wall_s']:>8.0f}")
        print(f"  training reward per step: {a['training_reward']}")
    checks = {}
    if "verifiers" in arms:
        v = arms["verifiers"]
        checks["verifiers_learns"] = v["after"]["pass@1"] >= v["before"]["pass@1"] + MARGIN
        checks["verifiers_no_episode_errors"] = v["episode_errors"] == 0
        if "dppo" in arms:
            checks["verifiers_like_dppo"] = abs(v["after"]["pass@1"] - arms["dppo"]["after"]["pass@1"]) <= TOLERANCE
    emit({"benchmark": "verifiers_learning", "seed": args.seed, "client": args.client, "steps": args.steps or 30,
          "arms": arms, "checks": checks})


if __name__ == "__main__":
    main()
