"""Rollout throughput: the `hf` engine vs the `vllm` engine on the same model and prompts, with and without
top-K log-prob capture.

Both engines load the same weights in the same dtype (a ~10M random Qwen2-like model with token-id prompts,
and SmolLM2-135M with chat prompts; bf16 by default), sample at temperature 1 and generate exactly `--new`
tokens per prompt: EOS is ignored by emptying each engine's `eos_ids`, so both do the same work. Every
configuration (engine x K) runs once per round, interleaved, for `--repeats` rounds; the table shows the
median tokens/s, and the ratios (vLLM/HF, and the cost of top-K capture = 1 - tok/s with K / tok/s without)
as medians of per-round ratios, which other processes' load disturbs less than the rates themselves.
Targets: vLLM >= 2x HF on SmolLM2; top-K capture <= 10%. Prints a table, then exactly one JSON line.

Threads: one by default. On a shared 2-core machine, 2 OpenMP threads collapse under load from other processes
(spin-waiting: the HF engine fell from ~330 to 15-90 tok/s at load average 6), so only 1 thread gives
comparable numbers there; use --threads 2 (or 0) on an idle machine.

    nice .venv/bin/python benchmarks/bench_rollout.py            # 16 prompts x 128 tokens, both models
    nice .venv/bin/python benchmarks/bench_rollout.py --quick    # random-10m, 8 x 32, one round
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from dppo.runtime.models import load_model, load_tokenizer, resolve_model_path, save_model, tiny_random_model
from dppo.rollout.base import SamplingParams
from dppo.rollout.hf import HFEngine
from dppo.rollout.vllm import VLLMEngine

from common import QUESTIONS, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

TARGET_SPEEDUP = 2.0
"""vLLM / HF tokens/s on SmolLM2 (no top-K)."""
TARGET_TOPK_COST = 0.10
"""Largest acceptable throughput loss from recording top-K log-probs."""


def build_engines(name: str, dtype: torch.dtype, folder: str, kv_cache_gb: float):
    """(hf engine, vllm engine, prompts) for a benchmark model; both engines ignore EOS."""
    if name == "random-10m":  # ~10.5M parameters, vocab 8k, head size 32 (vLLM's CPU minimum)
        model = tiny_random_model(8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                                  intermediate_size=1024, dtype=dtype)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 8192, (int(torch.randint(24, 64, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(len(QUESTIONS))]
        save_model(model, _NoTokenizer(), folder)
        hf, vllm = HFEngine(model, None, dtype=dtype), VLLMEngine(folder, dtype=dtype, kv_cache_gb=kv_cache_gb)
    else:
        path = resolve_model_path(name)
        tokenizer = load_tokenizer(path)
        model = load_model(path, dtype=dtype)
        prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
        hf = HFEngine(model, tokenizer, dtype=dtype)
        vllm = VLLMEngine(path, tokenizer, dtype=dtype, kv_cache_gb=kv_cache_gb)
    hf.eos_ids, vllm.eos_ids = set(), set()  # both read eos_ids at each generate: exactly max_new_tokens
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return hf, vllm, prompts, params


class _NoTokenizer:
    """Stand-in so that `save_model` can save a model without a tokenizer."""

    def save_pretrained(self, folder) -> None:
        pass


def run(engine, prompts, *, new: int, topk: int, seed: int) -> tuple[int, float]:
    start = time.perf_counter()
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=new, top_k_logprobs=topk, seed=seed))
    elapsed = time.perf_counter() - start
    tokens = sum(int(r.response_ids.numel()) for r in rollouts)
    if tokens != len(prompts) * new:
        raise RuntimeError(f"expected {len(prompts) * new} tokens, got {tokens} (EOS not ignored?)")
    return tokens, elapsed


def bench_model(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="dppo-bench-") as folder:
        hf, vllm, prompts, params = build_engines(name, dtype, folder, args.kv_cache_gb)
        prompts = prompts[: args.prompts]
        for engine in (hf, vllm):  # warm-up
            run(engine, prompts[:2], new=4, topk=args.topk, seed=0)
        configs = [("hf", hf, 0), ("hf", hf, args.topk), ("vllm", vllm, 0), ("vllm", vllm, args.topk)]
        rates: dict[tuple[str, int], list[float]] = {(e, k): [] for e, _, k in configs}
        for rnd in range(args.repeats):  # interleaved, so that load from other processes hits all alike
            for engine_name, engine, k in configs if rnd % 2 == 0 else configs[::-1]:  # alternate: cancels drift
                tokens, secs = run(engine, prompts, new=args.new, topk=k, seed=rnd)
                rates[(engine_name, k)].append(tokens / secs)
        vllm.close()
    tps = {key: statistics.median(v) for key, v in rates.items()}
    K = args.topk

    def paired(a: tuple[str, int], b: tuple[str, int]) -> float:
        """Median over rounds of rate(a) / rate(b): runs of one round are seconds apart, so they see similar load."""
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    return {
        "params_m": round(params, 1),
        "hf_tok_s": round(tps[("hf", 0)], 1),
        "hf_topk_tok_s": round(tps[("hf", K)], 1),
        "vllm_tok_s": round(tps[("vllm", 0)], 1),
        "vllm_topk_tok_s": round(tps[("vllm", K)], 1),
        "vllm_over_hf": round(paired(("vllm", 0), ("hf", 0)), 2),
        "vllm_over_hf_topk": round(paired(("vllm", K), ("hf", K)), 2),
        "hf_topk_cost": round(1 - paired(("hf", K), ("hf", 0)), 3),
        "vllm_topk_cost": round(1 - paired(("vllm", K), ("vllm", 0)), 3),
        "rounds": {f"{e}_k{k}": [round(x, 1) for x in v] for (e, k), v in rates.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="random-10m,smollm2-135m", help="comma-separated: random-10m, "
                    "smollm2-135m or model folders")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--topk", type=int, default=20, help="K for the top-K capture runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds, median reported (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines (0 = torch's default)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="random-10m only, 8 prompts x 32 tokens, one round")
    args = ap.parse_args()
    if args.quick:
        args.models, args.prompts, args.new = "random-10m", 8, 32
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {name: bench_model(name, args) for name in args.models.split(",")}

    print(f"\n{args.prompts} prompts x {args.new} new tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved rounds, top-K = {args.topk}")
    head = f"{'model':<14}{'HF tok/s':>10}{'vLLM tok/s':>12}{'vLLM/HF':>9}{'HF+K':>9}{'vLLM+K':>9}" \
           f"{'vLLM/HF+K':>11}{'K cost HF':>11}{'K cost vLLM':>13}"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        print(f"{name:<14}{r['hf_tok_s']:>10.1f}{r['vllm_tok_s']:>12.1f}{r['vllm_over_hf']:>8.2f}x"
              f"{r['hf_topk_tok_s']:>9.1f}{r['vllm_topk_tok_s']:>9.1f}{r['vllm_over_hf_topk']:>10.2f}x"
              f"{r['hf_topk_cost']:>10.1%}{r['vllm_topk_cost']:>13.1%}")
    targets = {}
    if "smollm2-135m" in results:
        targets["vllm_2x_hf_smollm2"] = results["smollm2-135m"]["vllm_over_hf"] >= TARGET_SPEEDUP
    targets["topk_cost_le_10pct"] = all(max(r["hf_topk_cost"], r["vllm_topk_cost"]) <= TARGET_TOPK_COST
                                        for r in results.values())
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    emit({"bench": "rollout", "prompts": args.prompts, "new": args.new, "dtype": args.dtype,
          "topk": args.topk, "threads": torch.get_num_threads(), "repeats": args.repeats,
          "results": results, "targets": targets})


if __name__ == "__main__":
    main()
