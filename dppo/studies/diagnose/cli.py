"""`dppo diagnose`: the engine-vs-trainer mismatch report of a model (paper Fig. 2).

    dppo diagnose [--model smollm2-135m] [--engine auto|hf|vllm] [--engine-dtype bfloat16[,float16,...]]
                  [--trainer-precision fp32[,bf16,fp16]] [--batch-shape] [--task chain_sum]
                  [--task-options JSON] [--n-prompts 16] [--n 4] [--max-new-tokens 64] [--temperature 1.0]
                  [--top-k 20] [--seed 0] [--out-dir runs/diagnose-<timestamp>]

Prints one row per µ bucket of the first (engine, trainer) pair (token count, spread of r − 1, mean |π − µ|, Top-K
TV, top-K coverage, masked fractions of PPO-clip and DPPO-Binary-TV for Â > 0 / Â < 0), then one row per precision
pair (share of π/µ outside [0.9, 1.1], mean Binary TV, share above δ = 0.15) and with --batch-shape the same
statistics of one-response-at-a-time scoring against batch scoring, and the paths of the JSON and PNGs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json

from dppo.studies.diagnose.run import run_diagnose


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dppo diagnose", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or local model folder")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "vllm"), help="inference engine (auto: vLLM if installed)")
    p.add_argument("--engine-dtype", default="bfloat16", help="engine dtype(s): bfloat16, float16, float32, comma-separated")
    p.add_argument("--trainer-precision", default="fp32", help="trainer precision(s): fp32, bf16, fp16 (autocast), comma-separated")
    p.add_argument("--batch-shape", action="store_true", help="also score each response alone (the batch-shape effect)")
    p.add_argument("--task", default="chain_sum", help="task name (dppo.tasks.make_task)")
    p.add_argument("--task-options", default="{}", help="task options as a JSON object")
    p.add_argument("--n-prompts", type=int, default=16, help="number of prompts")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="maximum response length")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=20, help="µ's top-K recorded by the engine (0: no Top-K metrics)")
    p.add_argument("--seed", type=int, default=0, help="sampling and task seed")
    p.add_argument("--out-dir", default=None, help="output folder (default: runs/diagnose-<timestamp>)")
    return p


def _fmt(x, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    """One line per µ bucket: count, r − 1 quantiles, |π − µ| mean / q95, Top-K TV mean, coverage, masks."""
    regions = list(report["trust_regions"])
    head = (f"{'µ bucket':<18}{'tokens':>7}{'r-1 q05':>10}{'r-1 q50':>10}{'r-1 q95':>10}{'|π-µ| mean':>11}"
            f"{'|π-µ| q95':>10}{'topK TV':>9}{'cover':>7}" + "".join(f"{r + ' +/-':>22}" for r in regions))
    lines = [head]
    for row in report["buckets"] + [{**report["overall"], "label": "all"}]:
        r, tv = row.get("ratio_minus_1") or {}, row.get("binary_tv") or {}
        ktv, cov = row.get("topk_tv") or {}, row.get("topk_coverage") or {}
        masks = "".join(f"{_fmt((row['masked_frac'].get(g) or {}).get('pos'), '.3f'):>15}/"
                        f"{_fmt((row['masked_frac'].get(g) or {}).get('neg'), '.3f'):<6}" for g in regions)
        lines.append(f"{row['label']:<18}{row['count']:>7}{_fmt(r.get('q05')):>10}{_fmt(r.get('q50')):>10}"
                     f"{_fmt(r.get('q95')):>10}{_fmt(tv.get('mean')):>11}{_fmt(tv.get('q95')):>10}"
                     f"{_fmt(ktv.get('mean'), '.3f'):>9}{_fmt(cov.get('mean'), '.3f'):>7}{masks}")
    return "\n".join(lines)


def format_pairs(report: dict) -> str:
    """One line per (engine dtype, trainer precision) pair, then the batch-shape rows."""
    lines = [f"{'engine':<10}{'trainer':>8}{'out 0.9-1.1':>13}{'binary TV':>11}{'TV>0.15':>9}"]
    for r in report["precision_pairs"]:
        lines.append(f"{r['engine_dtype']:<10}{r['trainer_precision']:>8}{r['out_0.9_1.1']:>13.2%}"
                     f"{r['binary_tv_mean']:>11.2e}{r['tv_over_delta']:>9.2%}")
    for r in report["batch_shape"]:
        lines.append(f"{'1 vs all':<10}{r['trainer_precision']:>8}{r['out_0.9_1.1']:>13.2%}"
                     f"{r['binary_tv_mean']:>11.2e}{r['tv_over_delta']:>9.2%}")
    return "\n".join(lines)


def cmd_diagnose(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        options = json.loads(args.task_options)
    except json.JSONDecodeError as exc:
        print(f"error: --task-options: not valid JSON ({exc})")
        return 2
    if not isinstance(options, dict):
        print("error: --task-options: expected a JSON object")
        return 2
    out_dir = args.out_dir or f"runs/diagnose-{_dt.datetime.now():%Y%m%d-%H%M%S}"

    try:
        report = run_diagnose(args.model, engine=args.engine, engine_dtype=args.engine_dtype,
                              trainer_precision=args.trainer_precision, batch_shape=args.batch_shape, task=args.task,
                              task_options=options, n_prompts=args.n_prompts, n=args.n,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              seed=args.seed, out_dir=out_dir)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    c = report["config"]
    print(f"{c['model']}: {c['engine']} {c['engine_dtype']} engine vs {c['trainer_precision']} trainer, "
          f"{report['num_responses']} responses, {report['num_tokens']} tokens (masked fractions for Â = +1 / −1)")
    print(format_table(report))
    print(format_pairs(report))
    for name, path in report["files"].items():
        print(f"{name}: {path}")
    return 0
