"""What `--loss.split-mismatch` costs: the one no-grad forward over the batch (the trainer's "recompute" phase) as a
share of the step, measured inside the same run (every step times its phases), with the step's other phases beside
it. The split costs the same as `--loss.anchor recompute` and nothing more with it.

    nice .venv/bin/python benchmarks/bench_split_mismatch.py                   # SmolLM2-135M, demo shape, 4 steps
    nice .venv/bin/python benchmarks/bench_split_mismatch.py --model tiny --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from dppo.train.config import replace
from dppo.train.presets import get_preset
from dppo.train.trainer import Trainer

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

PHASES = ("generation", "reward", "recompute", "training", "sync", "metrics")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--steps", type=int, default=4, help="steps timed (after one warm-up step)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = get_preset("demo" if args.model == "smollm2" else "smoke")
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = replace(base, loss={"split_mismatch": True},
                      rollout={"engine": "hf", "dtype": "float32"}, model={"dtype": "float32"},
                      train={"steps": args.steps + 1, "eval_before": False, "eval_every": 0, "threads": args.threads},
                      log={"run_dir": run_dir, "report_to": ("none",), "progress": False, "samples_per_step": 0})
        trainer = Trainer(cfg, run_dir)
        try:
            rows = [trainer.step() for _ in range(args.steps + 1)][1:]
        finally:
            trainer.close()
    med = {k: statistics.median(r.get(f"perf/{k}_s", 0.0) for r in rows) for k in PHASES}
    step = statistics.median(r["perf/step_s"] for r in rows)
    share = statistics.median(r["perf/recompute_s"] / r["perf/step_s"] for r in rows)
    print(f"{'phase':<12}{'median s':>10}{'share of step':>15}")
    for k in PHASES:
        print(f"{k:<12}{med[k]:>10.3f}{med[k] / step:>15.1%}")
    print(f"{'step':<12}{step:>10.3f}{1.0:>15.1%}")
    print(f"split-mismatch forward (recompute phase) / step, median over {len(rows)} steps: {share:.1%}")
    split = {k: statistics.mean(r[k] for r in rows) for k in ("mismatch/old_rollout_tv_mean",
                                                               "mismatch/current_old_tv_mean")}
    emit({"bench": "split_mismatch", "model": args.model, "steps": len(rows), "threads": args.threads,
          "step_s": step, "recompute_s": med["recompute"], "recompute_share": share, **split})


if __name__ == "__main__":
    main()
