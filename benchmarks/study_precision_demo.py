"""The demo task by training and engine precision (issue 34's study): pass@1 after the demo's 30 steps, seeds side by side.

Each cell of the grid is one `dppo train` of the demo preset (SmolLM2-135M-Instruct, chain_sum, 8 × 8 per step, 30
steps, pass@1 over 64 held-out questions × 2 samples before and after) with only three things changed: the method
(`dppo`: DPPO-Binary-TV δ = 0.15, the demo's; `binary-kl`: DPPO-Binary-KL δ = 0.05; `grpo`: the GRPO ratio clip
0.2/0.2, the `grpo` preset; `clip-higher`, `minirl`, `cispo`, `pg-is`, `icepop`, `gspo`, `geo-mask`, `tis`: the
presets of those names, see `METHODS`), the
engine's dtype (`--rollout.dtype`: bfloat16 or float16; vLLM as `auto` picks) and the trainer's precision
(`--model.precision`: fp32, bf16 = bf16 autocast, fp16 = fp16 autocast with a gradient scaler). A cell is named
`METHOD:ENGINE:TRAINER`, e.g. `dppo:bf16:fp32`.

Runs go one after the other as subprocesses (`dppo train`, each its own process and engine), in the order given:
name the cells in priority order (the whole grid, 12 cells × 3 seeds at ~9 min a run on 2 cores, is ~5 h; the
first pairs alone answer "does bf16 autocast keep the fp32 trainer's pass@1"), with `--order seed` interleaving the
cells within each seed so that an interrupted study still holds matched seeds. A run whose `eval.jsonl` already
holds its final evaluation is not run again, so the command resumes where it stopped and `--report` only reads.

Reported per cell: pass@1 before and after (mean, min–max, per seed), the training reward of the first / last 5
steps, the median step (steps 2–30) and its training / generation parts, mismatch/binary_tv_mean (mean of all steps
and of the last 5), the masked share (mean; and of the tokens with Â > 0 / Â < 0), the fp16 scaler's skipped steps and the wall time of the whole run.
Prints a table, then one JSON line.

    nice .venv/bin/python benchmarks/study_precision_demo.py --out runs/precision-study \\
        --cells dppo:bf16:fp32,dppo:bf16:bf16 --seeds 0,1,2 --order seed      # ~54 min on 2 free cores
    .venv/bin/python benchmarks/study_precision_demo.py --out runs/precision-study --report   # the table only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_name, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

METHODS = {"dppo": ("demo", ()), "binary-kl": ("dppo-binary-kl", ()), "grpo": ("grpo", ()),
           "clip-higher": ("grpo-clip-higher", ()), "minirl": ("minirl", ()), "cispo": ("cispo", ()),
           "pg-is": ("pg-is", ()), "icepop": ("icepop", ()), "gspo": ("gspo", ()),
           "geo-mask": ("geo-mask", ("--loss.sequence-delta", "0.03")), "tis": ("tis", ())}
"""The method of a cell -> the preset it runs and its flags (every preset but `demo` is the demo with only the loss
changed; the field's corrections of issue 35 with the parameters its lag-4 study chose on seed 0: IcePop [0.5, 2],
GSPO 3e-4 / 4e-4, the geometric mask 1 ± 0.03, TIS C = 2)."""
ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TRAINER_PRECISIONS = ("fp32", "bf16", "fp16")
ROOT = Path(__file__).resolve().parents[1]


def parse_cell(cell: str) -> tuple[str, str, str]:
    """`METHOD:ENGINE:TRAINER` -> its three parts, each checked (a clear error names the bad part)."""
    parts = cell.split(":")
    if len(parts) != 3:
        raise SystemExit(f"--cells: {cell!r} is not METHOD:ENGINE:TRAINER (e.g. dppo:bf16:fp32)")
    method, engine, trainer = parts
    for value, allowed, what in ((method, METHODS, "method"), (engine, ENGINE_DTYPES, "engine dtype"),
                                 (trainer, TRAINER_PRECISIONS, "trainer precision")):
        if value not in allowed:
            raise SystemExit(f"--cells: {what} {value!r} in {cell!r} is not one of {', '.join(allowed)}")
    return method, engine, trainer


def run_dir(out: Path, cell: str, seed: int) -> Path:
    return out / f"{cell.replace(':', '-')}-s{seed}"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_eval(directory: Path, steps: int) -> dict | None:
    """The evaluation the run wrote after its last step (None while the run is incomplete)."""
    rows = [r for r in read_jsonl(directory / "eval.jsonl") if r.get("step") == steps and "pass@1" in r]
    return rows[-1] if rows else None


def train(out: Path, cell: str, seed: int, steps: int, extra: list[str]) -> None:
    method, engine, trainer = parse_cell(cell)
    directory = run_dir(out, cell, seed)
    if final_eval(directory, steps) is not None:
        print(f"[study] {directory.name}: complete, not run again", flush=True)
        return
    if directory.exists():  # an interrupted run: start it again from scratch (its wall time must be whole)
        shutil.rmtree(directory)
    preset, method_flags = METHODS[method]
    cmd = [sys.executable, "-m", "dppo.cli", "train", "--preset", preset, *method_flags, "--run-dir", str(directory),
           "--rollout.dtype", ENGINE_DTYPES[engine], "--model.precision", trainer, "--train.seed", str(seed),
           "--train.steps", str(steps), *extra]
    print(f"[study] {directory.name}: dppo {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{directory.name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"[study] {directory.name} failed (exit {rc}): see {out / (directory.name + '.log')}")
    (directory / "study_wall_s.json").write_text(json.dumps({"wall_s": wall}))
    print(f"[study] {directory.name}: done in {wall / 60:.1f} min", flush=True)


def summarize_run(directory: Path, steps: int) -> dict | None:
    end = final_eval(directory, steps)
    if end is None:
        return None
    start = [r for r in read_jsonl(directory / "eval.jsonl") if r.get("step") == 0 and "pass@1" in r]
    rows = [r for r in read_jsonl(directory / "metrics.jsonl") if "perf/step_s" in r]
    later = rows[1:] or rows

    def median(key: str) -> float:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else float("nan")

    def mean(key: str, rows_=rows) -> float:
        values = [r[key] for r in rows_ if key in r]
        return statistics.fmean(values) if values else float("nan")

    wall = directory / "study_wall_s.json"
    return {
        "pass1_before": start[-1]["pass@1"] if start else float("nan"), "pass1_after": end["pass@1"],
        "reward_first5": mean("reward/mean", rows[:5]), "reward_last5": mean("reward/mean", rows[-5:]),
        "step_s": median("perf/step_s"), "training_s": median("perf/training_s"),
        "generation_s": median("perf/generation_s"),
        "mismatch_tv": mean("mismatch/binary_tv_mean"), "mismatch_tv_last5": mean("mismatch/binary_tv_mean", rows[-5:]),
        "masked": mean("trust_region/masked_frac"), "masked_pos": mean("trust_region/masked_frac_pos"),
        "masked_neg": mean("trust_region/masked_frac_neg"),
        "scaler_skipped": rows[-1].get("optim/skipped_steps_total", 0.0) if rows else float("nan"),
        "wall_s": json.loads(wall.read_text())["wall_s"] if wall.exists() else float("nan"),
    }


def summarize(out: Path, cells: list[str], seeds: list[int], steps: int) -> dict[str, dict]:
    table = {}
    for cell in cells:
        runs = {s: summarize_run(run_dir(out, cell, s), steps) for s in seeds}
        runs = {s: r for s, r in runs.items() if r is not None}
        if not runs:
            continue
        agg = {k: statistics.fmean(r[k] for r in runs.values()) for k in next(iter(runs.values()))}
        after = [r["pass1_after"] for r in runs.values()]
        table[cell] = {**agg, "seeds": sorted(runs), "pass1_after_min": min(after), "pass1_after_max": max(after),
                       "per_seed": {s: round(r["pass1_after"], 3) for s, r in runs.items()}}
    return table


def add_paired(table: dict[str, dict], baseline: str) -> None:
    """Each cell's pass@1 after, minus the baseline cell's on the same seeds: mean and standard error (n - 1)."""
    if baseline not in table:
        raise SystemExit(f"--baseline: {baseline!r} has no finished run among --cells")
    base = table[baseline]["per_seed"]
    for cell, row in table.items():
        diffs = [row["per_seed"][s] - base[s] for s in row["per_seed"] if s in base]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None  # one seed: no error estimate
        row["delta"] = None if cell == baseline or not diffs else {
            "mean": statistics.fmean(diffs), "se": se, "seeds": len(diffs)}


def print_table(table: dict[str, dict]) -> None:
    def delta(d: dict | None) -> str:
        if d is None:
            return "-"
        se = "n/a" if d["se"] is None else f"{d['se']:.3f}"
        return f"{d['mean']:+.3f} +- {se} ({d['seeds']})"

    head = ("cell", "seeds", "pass@1 before", "pass@1 after (min-max)", "per seed", "reward first/last 5",
            "step s", "train s", "gen s", "binary TV (last 5)", "masked", "masked A>0 / A<0", "skipped", "wall min", "paired delta (+- SE, seeds)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cell, r in table.items():
        print(f"| {cell} | {len(r['seeds'])} | {r['pass1_before']:.3f} | {r['pass1_after']:.3f} "
              f"({r['pass1_after_min']:.3f}-{r['pass1_after_max']:.3f}) | "
              f"{' '.join(f'{v:.3f}' for v in r['per_seed'].values())} | "
              f"{r['reward_first5']:.3f} / {r['reward_last5']:.3f} | {r['step_s']:.1f} | {r['training_s']:.1f} | "
              f"{r['generation_s']:.1f} | {r['mismatch_tv']:.2e} ({r['mismatch_tv_last5']:.2e}) | "
              f"{100 * r['masked']:.2f}% | {100 * r['masked_pos']:.2f}% / {100 * r['masked_neg']:.2f}% | "
              f"{r['scaler_skipped']:.0f} | {r['wall_s'] / 60:.1f} | {delta(r.get('delta'))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the study's folder (one run directory per cell and seed)")
    p.add_argument("--cells", default="dppo:bf16:fp32,dppo:bf16:bf16",
                   help="METHOD:ENGINE:TRAINER,... in priority order (method " + "|".join(METHODS) + "; engine bf16|fp16|fp32; "
                        "trainer fp32|bf16|fp16)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (the demo's 30)")
    p.add_argument("--order", choices=("cell", "seed"), default="seed",
                   help="seed: every cell of seed 0, then of seed 1, ... (matched seeds if interrupted); "
                        "cell: all seeds of a cell before the next")
    p.add_argument("--baseline", help="a cell of --cells: every other cell's pass@1 after minus its, paired by seed")
    p.add_argument("--report", action="store_true", help="only read the runs already there and print the table")
    p.add_argument("extra", nargs="*", help="more `dppo train` flags after `--`, the same for every run")
    args = p.parse_args()
    cells = [c for c in args.cells.split(",") if c]
    for cell in cells:
        parse_cell(cell)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        order = ([(c, s) for s in seeds for c in cells] if args.order == "seed" else
                 [(c, s) for c in cells for s in seeds])
        for cell, seed in order:
            train(out, cell, seed, args.steps, args.extra)
    table = summarize(out, cells, seeds, args.steps)
    if args.baseline:
        add_paired(table, args.baseline)
    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores")
    print_table(table)
    emit({"benchmark": "study_precision_demo", "steps": args.steps, "cells": table})


if __name__ == "__main__":
    main()
