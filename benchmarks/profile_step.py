"""Profile dppo training steps: where does a step's time go, by phase and by operator?

Builds a `Trainer` from a preset (default: the demo, SmolLM2-135M on chain_sum), runs `--warmup` steps, then
`--steps` steps under `torch.profiler` (CPU activities; CUDA too when the model is on a GPU). Prints the step's
phase breakdown (the trainer's own `perf/*_s` metrics, median over the profiled steps), the operators with the
largest self time, and a final JSON line. `--trace out.json` also writes a Chrome trace.

    nice .venv/bin/python benchmarks/profile_step.py                                 # demo preset, vllm engine
    nice .venv/bin/python benchmarks/profile_step.py --set rollout.engine=hf --set train.mini_batches=4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from torch.profiler import ProfilerActivity, profile

from dppo.train.config import replace
from dppo.train.presets import get_preset
from dppo.train.trainer import Trainer

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script


def parse_sets(items: list[str]) -> dict[str, dict]:
    """["rollout.engine=hf", "train.steps=3"] -> {"rollout": {"engine": "hf"}, "train": {"steps": 3}}."""
    sections: dict[str, dict] = {}
    for item in items:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if not field:
            raise SystemExit(f"--set {item!r}: expected section.field=value")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        sections.setdefault(section, {})[field] = parsed
    return sections


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--set", action="append", default=[], help="section.field=value (JSON value), repeatable")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", default="")
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(prefix="dppo-profile-")
    sets = parse_sets(args.set)
    cfg = get_preset(args.preset)
    cfg = replace(cfg, **{**sets, "train": {"eval_before": False, "steps": args.warmup + args.steps,
                                            **sets.get("train", {})},
                          "log": {"run_dir": run_dir, "progress": False, **sets.get("log", {})}})
    trainer = Trainer(cfg, run_dir)
    for _ in range(args.warmup):
        trainer.logger.log_step(trainer.step_idx + 1, trainer.step())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    rows = []
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(args.steps):
            metrics = trainer.step()
            trainer.logger.log_step(trainer.step_idx, metrics)
            rows.append(metrics)
    trainer.logger.close()
    trainer.close()
    phases = {k[5:-2]: statistics.median(r[k] for r in rows) for k in rows[0]
              if k.startswith("perf/") and k.endswith("_s") and k not in ("perf/tokens_per_s",)}
    print(f"phases (median of {args.steps} profiled steps, seconds): "
          + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    sort = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    emit({"benchmark": "profile_step", "preset": args.preset, "sets": sets, "phases_s": phases,
          "top_ops_self_cpu_s": {e.key: e.self_cpu_time_total / 1e6 / args.steps for e in top}})


if __name__ == "__main__":
    main()
