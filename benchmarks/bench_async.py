"""Synchronous vs asynchronous rollouts (`rollout.mode`) on the demo: step time, idle fractions, staleness, and the
projected speed-up where engine and trainer have devices of their own.

Runs the demo preset (SmolLM2-135M-Instruct, 8 prompts x 8 responses, the engine `auto` picks for this machine)
for `--steps` steps per variant, each in its own `dppo train` process, one after the other, without evaluation:

- `sync-2t`: the default synchronous loop, engine in the trainer's process, 2 threads (the whole machine);
- `sync-1t`: the same on 1 thread (the resources each side gets below);
- `async-k1` (and `--ks`): one rollout worker process with 1 thread beside a 1-thread trainer, rollout.max_staleness k.

Reported per variant: median over steps 2.. of the step time (1 / steps per second), the generation phase (sync:
generating; async: the trainer waiting for the batch), the training phase, the weight sync/publication, the
trainer's and the worker's idle fractions, and the mean staleness. The first step (start-up) is left out.

Projection (labelled as such): with engine and trainer on separate devices, a step costs max(g, t + p) instead
of g + t + p, where g, t are the generation and training phases of `sync-1t` and p its weight sync; the
projected speed-up is (g + t + p) / max(g, t + p). Prints a table, then exactly one JSON line. Compare rows of
one run; absolute times on a shared machine are noise.

    nice .venv/bin/python benchmarks/bench_async.py                 # 3 variants x 8 steps, ~6 min
    nice .venv/bin/python benchmarks/bench_async.py --steps 5 --ks 1,2
    .venv/bin/python benchmarks/bench_async.py --devices cuda:1      # GPU machine: the engine on a GPU of its own
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import demo_steps, emit  # benchmarks/ is on sys.path when a benchmark runs as a script


def run_variant(name: str, extra: list[str], steps: int, out: Path) -> dict:
    rows, wall = demo_steps(name, extra, steps, out)
    med = lambda key, default=0.0: statistics.median(r.get(key, default) for r in rows)  # noqa: E731
    return {"variant": name, "steps": steps, "wall_s": wall, "step_s": med("perf/step_s"),
            "generation_s": med("perf/generation_s"), "training_s": med("perf/training_s"),
            "recompute_s": med("perf/recompute_s"), "sync_s": med("perf/sync_s"),
            "trainer_idle_frac": med("async/trainer_idle_frac") if "async/trainer_idle_frac" in rows[0] else None,
            "worker_idle_frac": med("async/worker_idle_frac") if "async/worker_idle_frac" in rows[0] else None,
            "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows),
            "reward_mean": statistics.mean(r["reward/mean"] for r in rows)}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ks", default="1", help="comma-separated rollout.max_staleness values for the async variants")
    ap.add_argument("--devices", default="", help="rollout.devices of the async variants (e.g. cuda:1 on a GPU "
                                                  "machine: the engine on its own GPU); '' = the trainer's device")
    args = ap.parse_args()
    from dppo.runtime.hardware import cpu_name

    variants = [("sync-2t", ["--train.threads", "2"]), ("sync-1t", ["--train.threads", "1"])]
    for k in [int(x) for x in args.ks.split(",")]:
        variants.append((f"async-k{k}", ["--train.threads", "1", "--rollout.mode", "async", "--rollout.max-staleness",
                                         str(k), "--rollout.worker-threads", "1",
                                         *(["--rollout.devices", args.devices] if args.devices else [])]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants:
            results.append(run_variant(name, extra, args.steps, Path(tmp) / name))
            print(f"  {name}: median step {results[-1]['step_s']:.2f} s", file=sys.stderr, flush=True)
    by = {r["variant"]: r for r in results}
    base = by["sync-1t"]
    g, p = base["generation_s"], base["sync_s"]
    t = base["step_s"] - g - p  # training, recompute, reward, metrics: everything the trainer does itself
    projected = (g + t + p) / max(g, t + p)
    print(f"CPU: {cpu_name()}, 2 cores; demo preset, {args.steps} steps per variant, medians over steps 2..{args.steps}")
    print(f"{'variant':<10}{'step s':>8}{'gen/wait s':>11}{'train s':>9}{'sync s':>8}{'idle trainer':>13}"
          f"{'idle worker':>12}{'staleness':>10}{'vs sync-2t':>11}{'vs sync-1t':>11}")
    for r in results:
        print(f"{r['variant']:<10}{r['step_s']:>8.2f}{r['generation_s']:>11.2f}{r['training_s']:>9.2f}{r['sync_s']:>8.2f}"
              f"{_fmt(r['trainer_idle_frac']):>13}{_fmt(r['worker_idle_frac']):>12}{r['staleness_mean']:>10.2f}"
              f"{by['sync-2t']['step_s'] / r['step_s']:>10.2f}x{base['step_s'] / r['step_s']:>10.2f}x")
    print(f"projection (not a measurement), engine and trainer on separate devices: g = {g:.2f} s, t = {t:.2f} s, "
          f"p = {p:.2f} s -> (g + t + p) / max(g, t + p) = {projected:.2f}x")
    emit({"benchmark": "async", "cpu": cpu_name(), "steps": args.steps, "results": results,
          "projection": {"generation_s": g, "trainer_s": t, "publish_s": p, "speedup": projected}})


if __name__ == "__main__":
    main()
