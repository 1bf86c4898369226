"""Which engine and engine dtype make the demo step fastest on this machine: the evidence for `rollout.engine: auto`
and `rollout.dtype: auto` (`dppo.runtime.hardware`).

Runs the demo preset (SmolLM2-135M, 8 prompts x 8 responses, fp32 trainer) for `--steps` steps once per
(engine, engine dtype) pair, each in its own `dppo train` process, one after the other, with no evaluation, and
reports the median over steps 2.. of the step, generation and training seconds, and the mean engine/trainer
mismatch (Binary TV) of the run. The first step (start-up, allocator warm-up) is left out. Prints a table, then
exactly one JSON line. Absolute times on a shared machine are noise; compare the rows of one run.

    nice .venv/bin/python benchmarks/bench_engine_choice.py                    # 4 pairs x 8 steps, ~8 min
    nice .venv/bin/python benchmarks/bench_engine_choice.py --pairs hf:float32,vllm:bfloat16 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import demo_steps, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

def run_pair(engine: str, dtype: str, steps: int, out: Path) -> dict:
    rows, wall = demo_steps(f"{engine}/{dtype}", ["--rollout.engine", engine, "--rollout.dtype", dtype], steps, out)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"engine": engine, "dtype": dtype, "steps": steps, "wall_s": wall, "step_s": med("perf/step_s"),
            "generation_s": med("perf/generation_s"), "training_s": med("perf/training_s"),
            "sync_s": med("perf/sync_s"),
            "mismatch_binary_tv": statistics.mean(r["mismatch/binary_tv_mean"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="vllm:bfloat16,hf:bfloat16,vllm:float32,hf:float32",
                    help="comma-separated engine:dtype pairs")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from dppo.runtime.hardware import cpu_flags, cpu_name, native_bf16

    import torch

    native = native_bf16(torch.device("cpu"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.pairs.split(","):
            engine, dtype = pair.split(":")
            results.append(run_pair(engine, dtype, args.steps, Path(tmp) / pair.replace(":", "-")))
            print(f"  {pair}: median step {results[-1]['step_s']:.2f} s", file=sys.stderr, flush=True)
    fastest = min(results, key=lambda r: r["step_s"])
    print(f"CPU: {cpu_name()} ({'avx512f' in cpu_flags() and 'AVX-512' or 'no AVX-512'}; bf16 native: {native.value}); "
          f"demo preset, {args.steps} steps per pair, medians over steps 2..{args.steps}")
    print(f"{'engine':<7}{'dtype':<10}{'step s':>8}{'gen s':>8}{'train s':>9}{'sync s':>8}{'mismatch TV':>13}{'vs fastest':>12}")
    for r in results:
        print(f"{r['engine']:<7}{r['dtype']:<10}{r['step_s']:>8.2f}{r['generation_s']:>8.2f}{r['training_s']:>9.2f}"
              f"{r['sync_s']:>8.2f}{r['mismatch_binary_tv']:>13.2e}{r['step_s'] / fastest['step_s']:>11.2f}x")
    emit({"benchmark": "engine_choice", "cpu": cpu_name(), "bf16_native": native.value == "yes",
          "steps": args.steps, "results": results,
          "fastest": f"{fastest['engine']}:{fastest['dtype']}"})


if __name__ == "__main__":
    main()
