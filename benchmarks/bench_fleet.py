"""A mixed fleet against homogeneous engines on the demo task (issue 51 part 3): reward, masked share and mismatch per
engine, and whether a run collapsed.

Each arm is one `dppo train` of the demo preset (SmolLM2-135M-Instruct, DPPO-Binary-TV δ = 0.15, chain_sum, 8 prompts
× 8 responses per step, the demo's 30 steps, pass@1 over 64 held-out questions × 2 samples before and after) with the
fp32 trainer (`--model.precision fp32`, so that a float32 engine is the mismatch-free reference) and only the
rollout engines changed (`ARMS`): one hf engine in float32, in bfloat16 or with fp8 weights, or a fleet of them
(`--rollout.fleet`, prompts dealt in turn, so at the same samples per step each member samples its share). Every
response's µ is recorded by the engine that sampled it, so the importance weight and the trust region are exact per
token in every arm; what differs is how far each engine's µ is from the trainer's π.

Runs go one after the other, each in its own process; an arm whose `eval.jsonl` holds its final evaluation is not
run again (the command resumes; `--report` only reads). Reported per arm: pass@1 before and after, the training
reward of the first and last 5 steps, and per member (engine_j of a fleet, the one engine otherwise) its training
reward, Binary-TV mismatch (mean over steps; mismatch/binary_tv_engine_j, measured before each step's update) and
masked share (mean and largest step; trust_region/masked_frac_engine_j); "collapsed" = the last-5 training reward
fell below the first-5 by more than 0.05, pass@1 fell by more than 0.05, or a step was skipped. Prints a table,
then one JSON line (also written to `--json`).

    nice .venv/bin/python benchmarks/bench_fleet.py --out runs/fleet-study --arms fp32,bf16,fleet,fp8,fleet3 \
        --json docs/data/fleet/fleet_study.json                # ~46 min on 2 Zen 4 cores (docs/paper.md)
    .venv/bin/python benchmarks/bench_fleet.py --out runs/fleet-study --arms fp32,bf16,fleet,fp8,fleet3 --report
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, cpu_name, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

ARMS: dict[str, tuple[str, ...]] = {
    "fp32": ("--rollout.engine", "hf", "--rollout.dtype", "float32"),
    "bf16": ("--rollout.engine", "hf", "--rollout.dtype", "bfloat16"),
    "fp8": ("--rollout.engine", "hf", "--rollout.dtype", "float32", "--rollout.quantization", "fp8"),
    "fleet": ("--rollout.fleet", "hf:float32,hf:bfloat16"),
    "fleet3": ("--rollout.fleet", "hf:float32,hf:bfloat16,hf:float32:fp8"),
}
"""An arm's name -> its rollout flags (everything else is the demo preset with the fp32 trainer)."""
MEMBERS = {"fp32": ["hf float32"], "bf16": ["hf bfloat16"], "fp8": ["hf float32 fp8"],
           "fleet": ["hf float32", "hf bfloat16"], "fleet3": ["hf float32", "hf bfloat16", "hf float32 fp8"]}
"""An arm's engines, in the order of their `engine_{j}` metrics."""
COLLAPSE_DROP = 0.05


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def final_eval(directory: Path, steps: int) -> dict | None:
    rows = [r for r in read_jsonl(directory / "eval.jsonl") if r.get("step") == steps and "pass@1" in r]
    return rows[-1] if rows else None


def train(out: Path, arm: str, seed: int, steps: int, extra: list[str]) -> None:
    directory = out / f"{arm}-s{seed}"
    if final_eval(directory, steps) is not None:
        print(f"[fleet] {directory.name}: complete, not run again", flush=True)
        return
    if directory.exists():  # an interrupted run starts again (its wall time must be whole)
        shutil.rmtree(directory)
    cmd = [sys.executable, "-m", "dppo.cli", "train", "--preset", "demo", "--run-dir", str(directory),
           "--model.precision", "fp32", *ARMS[arm], "--train.seed", str(seed), "--train.steps", str(steps),
           "--log.no-progress", "--log.report-to", "none", *extra]
    print(f"[fleet] {directory.name}: dppo {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{directory.name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc != 0:
        raise SystemExit(f"[fleet] {directory.name} failed (exit {rc}): see {out / (directory.name + '.log')}")
    (directory / "wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0}))
    print(f"[fleet] {directory.name}: done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


def summarize(directory: Path, arm: str, steps: int) -> dict | None:
    end = final_eval(directory, steps)
    if end is None:
        return None
    start = [r for r in read_jsonl(directory / "eval.jsonl") if r.get("step") == 0 and "pass@1" in r]
    rows = [r for r in read_jsonl(directory / "metrics.jsonl") if "perf/step_s" in r]

    def mean(key: str, rows_=rows) -> float:
        values = [r[key] for r in rows_ if key in r]
        return statistics.fmean(values) if values else float("nan")

    fleet = len(MEMBERS[arm]) > 1
    members = []
    for j, name in enumerate(MEMBERS[arm]):
        key = (lambda metric: f"{metric}_engine_{j}") if fleet else (lambda metric: metric)
        masked = [r[key("trust_region/masked_frac")] for r in rows if key("trust_region/masked_frac") in r]
        members.append({"engine": name, "reward": mean(key("reward/mean")),
                        "mismatch": mean(key("mismatch/binary_tv") if fleet else "mismatch/binary_tv_mean"),
                        "masked": statistics.fmean(masked), "masked_max": max(masked)})
    summary = {
        "arm": arm, "flags": " ".join(ARMS[arm]), "pass1_before": start[-1]["pass@1"] if start else float("nan"),
        "pass1_after": end["pass@1"], "reward_first5": mean("reward/mean", rows[:5]),
        "reward_last5": mean("reward/mean", rows[-5:]), "mismatch": mean("mismatch/binary_tv_mean"),
        "masked": mean("trust_region/masked_frac"), "skipped": rows[-1].get("optim/skipped_steps_total", 0.0),
        "step_s": statistics.median(r["perf/step_s"] for r in rows[1:] or rows),
        "wall_s": json.loads((directory / "wall_s.json").read_text())["wall_s"]
        if (directory / "wall_s.json").exists() else float("nan"),
        "members": members,
    }
    summary["collapsed"] = bool(summary["reward_last5"] < summary["reward_first5"] - COLLAPSE_DROP
                                or summary["pass1_after"] < summary["pass1_before"] - COLLAPSE_DROP
                                or summary["skipped"] > 0)
    return summary


def print_table(results: list[dict]) -> None:
    """One row per engine of each arm; the arm's own columns on its first row."""
    head = ("arm", "engine", "pass@1 before → after", "train reward first 5 → last 5", "engine's reward",
            "engine's binary TV", "engine's masked share (max step)", "collapsed", "step s", "wall min")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        for i, m in enumerate(r["members"]):
            arm = [r["arm"], m["engine"], f"{r['pass1_before']:.3f} → {r['pass1_after']:.3f}",
                   f"{r['reward_first5']:.3f} → {r['reward_last5']:.3f}"] if i == 0 else ["", m["engine"], "", ""]
            engine = [f"{m['reward']:.3f}", f"{m['mismatch']:.2e}",
                      f"{100 * m['masked']:.2f}% ({100 * m['masked_max']:.2f}%)"]
            tail = ["yes" if r["collapsed"] else "no", f"{r['step_s']:.1f}", f"{r['wall_s'] / 60:.1f}"] if i == 0 \
                else ["", "", ""]
            print("| " + " | ".join(arm + engine + tail) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the study's folder (one run directory per arm)")
    p.add_argument("--arms", default="fp32,bf16,fleet", help="comma-separated, in order: " + ", ".join(ARMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30, help="training steps per run (the demo's 30)")
    p.add_argument("--report", action="store_true", help="only read the runs already there and print the table")
    p.add_argument("--json", help="also write the final JSON line's payload to this file")
    p.add_argument("extra", nargs="*", help="more `dppo train` flags after `--`, the same for every arm")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown[0]!r}; valid: {', '.join(ARMS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for arm in arms:
            train(out, arm, args.seed, args.steps, args.extra)
    results = [s for s in (summarize(out / f"{a}-s{args.seed}", a, args.steps) for a in arms) if s is not None]
    print(f"\nthe demo with the fp32 trainer, seed {args.seed}, {args.steps} steps; {cpu_name()}\n")
    print_table(results)
    payload = {"benchmark": "fleet", "cpu": cpu_name(), "seed": args.seed, "steps": args.steps, "arms": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    emit(payload)


if __name__ == "__main__":
    main()
