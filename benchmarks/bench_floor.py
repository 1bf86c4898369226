"""The demo step against its compute floor (issue 34, item 4): the FLOPs each phase of a step needs, the machine's
measured GEMM peak, and the share of that peak each phase reaches.

    .venv/bin/python benchmarks/bench_floor.py                 # runs the demo for --steps 5 steps, then the table
    .venv/bin/python benchmarks/bench_floor.py --run-dir RUN   # the table of an existing run's steps 2..

The peak is measured here, on this machine, with this torch: the best of 5 square matmuls (n = 2048) in float32 and
in bfloat16 (torch's own threads). The FLOPs are counted from the model's config and the step's token counts, dense
matmuls only (the linear layers, attention's QK^T and AV over the causal context, the lm-head where it runs):
- generation: the prompts' prefill once per prompt (both engines share a prompt's prefix across its samples) and
  every sampled token's decode, the lm-head at the last prompt position and at every sampled token;
- training forward: each prompt once, its responses packed behind it (dppo's layout), the lm-head at response
  positions only, once per epoch; backward: twice the forward (activations' and weights' gradients);
- recompute: a forward without gradient (the recompute anchor, or the mismatch split), once per step.
Precision of each phase: the engine's dtype for generation, the trainer's resolved precision for the others.
The floor of a phase = its FLOPs / the peak of its precision; "share" = floor / measured time. Times: the median
over steps 2.. of the run's `perf/*_s`. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from common import demo_steps, emit, timed


def gemm_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of the best of `reps` [n, n] @ [n, n] matmuls in `dtype` (after one warm-up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def token_flops(cfg) -> dict[str, float]:
    """Forward FLOPs per token of a decoder's linear layers (`linear`), per token and attended position
    (`attention`: QK^T and AV, 4·L·d per pair), and of its lm-head (`head`), from a transformers config."""
    d, layers, ffn = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads) or heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * ffn  # q, o; k, v; gate, up, down
    return {"linear": 2.0 * layers * per_layer, "attention": 4.0 * layers * heads * head_dim,
            "head": 2.0 * d * cfg.vocab_size}


def step_flops(per: dict[str, float], prompt_len: float, response_len: float, prompts: int, group: int,
               epochs: int) -> dict[str, float]:
    """FLOPs of one step's phases (module docstring) for `prompts` prompts of `prompt_len` tokens, `group` responses
    each of `response_len` tokens (means), trained for `epochs` epochs."""
    lin, att, head = per["linear"], per["attention"], per["head"]
    ctx_prompt = (prompt_len + 1) / 2  # mean causal context inside a prompt
    ctx_response = prompt_len + (response_len + 1) / 2
    prefill = prompts * prompt_len * (lin + att * ctx_prompt) + prompts * head
    decode = prompts * group * response_len * (lin + att * ctx_response + head)
    forward = (prompts * prompt_len * (lin + att * ctx_prompt)
               + prompts * group * response_len * (lin + att * ctx_response + head))
    return {"generation": prefill + decode, "forward": epochs * forward, "backward": 2 * epochs * forward,
            "recompute": forward}


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=None, help="an existing run (its config.yaml and metrics.jsonl)")
    ap.add_argument("--steps", type=int, default=5, help="demo steps to run when --run-dir is not given")
    ap.add_argument("--extra", default="", help="extra `dppo train` flags for the demo run, one string")
    args = ap.parse_args()
    if args.run_dir is None:
        out = Path(tempfile.mkdtemp(prefix="floor-")) / "run"
        rows, _ = demo_steps("demo", args.extra.split(), args.steps, out)
        run = out
    else:
        run = Path(args.run_dir)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    if not rows:
        raise SystemExit(f"{run}: no step after the first in metrics.jsonl")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    from transformers import AutoConfig

    from dppo.runtime.models import resolve_model_path

    hf = AutoConfig.from_pretrained(resolve_model_path(cfg["model"]["name"]))
    prompts, group = cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]
    epochs = cfg["train"].get("epochs", 1)
    prompt_len = _median(rows, "perf/prompt_tokens") / (prompts * group)
    response_len = _median(rows, "perf/response_tokens") / (prompts * group)
    flops = step_flops(token_flops(hf), prompt_len, response_len, prompts, group, epochs)
    peaks = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16)}
    engine_prec = "bf16" if cfg["rollout"]["dtype"] in ("bfloat16", "bf16") else "fp32"
    train_prec = "bf16" if cfg["model"].get("precision") == "bf16" else "fp32"
    phases = [("generation", "perf/generation_s", engine_prec), ("forward", "perf/forward_s", train_prec),
              ("backward", "perf/backward_s", train_prec), ("recompute", "perf/recompute_s", train_prec)]
    table = []
    for phase, key, prec in phases:
        t = _median(rows, key)
        if phase == "recompute" and t < 1e-3:  # the phase did not run (rollout anchor, no mismatch split)
            continue
        floor = flops[phase] / (peaks[prec] * 1e9)
        table.append({"phase": phase, "precision": prec, "seconds": t, "gflop": flops[phase] / 1e9,
                      "gflop_s": flops[phase] / 1e9 / t if t else 0.0, "floor_s": floor,
                      "share_of_peak": floor / t if t else 0.0})
    step = _median(rows, "perf/step_s")
    floor_total = sum(r["floor_s"] for r in table)
    print(f"peak GEMM (n=2048, {torch.get_num_threads()} threads): fp32 {peaks['fp32']:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16']:.0f} GFLOP/s; {prompts} prompts x {group}, prompt {prompt_len:.1f} tokens, "
          f"response {response_len:.1f} tokens, {len(rows)} steps")
    print(f"{'phase':<11} {'prec':>5} {'time s':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'floor s':>8} {'share':>6}")
    for r in table:
        print(f"{r['phase']:<11} {r['precision']:>5} {r['seconds']:>8.2f} {r['gflop']:>8.1f} {r['gflop_s']:>8.0f} "
              f"{r['floor_s']:>8.2f} {r['share_of_peak']:>6.1%}")
    print(f"step: {step:.2f} s median, floor {floor_total:.2f} s: {step / floor_total:.1f}x the floor")
    emit({"bench": "floor", "run_dir": str(run), "peaks_gflop_s": peaks, "phases": table, "step_s": step,
          "floor_s": floor_total, "step_over_floor": step / floor_total if floor_total else None,
          "prompt_len": prompt_len, "response_len": response_len, "steps": len(rows), "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
