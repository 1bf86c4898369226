"""Throughput of the `hf` rollout engine against plain `model.generate` on the same model and prompts.

Both sample at temperature 1 without truncation; tokens/s counts generated tokens (up to and including EOS).
By default both stop at EOS, so the two methods sample different lengths (compare over several repeats);
--fixed-length makes every response exactly --new tokens (generate: min_new_tokens; the engine: its EOS set
emptied), the like-for-like comparison. The engine also records log-probs (and top-K with --topk). Prints a
table, then one JSON line.

    .venv/bin/python benchmarks/bench_hf_generate.py --model random-10m
    .venv/bin/python benchmarks/bench_hf_generate.py --model smollm2-135m --prompts 16 --new 128
    .venv/bin/python benchmarks/bench_hf_generate.py --model smollm2-135m --prompts 2 --n 8   # shared prefill
"""

from __future__ import annotations

import argparse
import time

import torch

from dppo.runtime.models import char_tokenizer, load_model, load_tokenizer, tiny_random_model
from dppo.rollout.base import SamplingParams
from dppo.rollout.hf import HFEngine

from common import QUESTIONS, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

def build(name: str, dtype: torch.dtype):
    """(model, tokenizer-or-None, vocab) for a benchmark model name."""
    if name == "random-10m":  # ~10.5M parameters, vocab 8k, token-id prompts
        model = tiny_random_model(8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                                  intermediate_size=1024, dtype=dtype)
        return model, None
    if name == "tiny-random":
        return tiny_random_model(dtype=dtype), char_tokenizer()
    return load_model(name, dtype=dtype), load_tokenizer(name)


def prompt_ids(tokenizer, count: int, vocab: int) -> list[list[int]]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(4, vocab, (int(torch.randint(24, 64, (1,), generator=g)),), generator=g).tolist()
                for _ in range(count)]
    out = []
    for i in range(count):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def run_generate(model, prompts, n, new, pad_id, eos_id, seed, fixed) -> tuple[int, float]:
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=None,
                             top_p=None, max_new_tokens=new, min_new_tokens=new if fixed else None,
                             num_return_sequences=n, pad_token_id=pad_id, eos_token_id=eos_id)
    elapsed = time.perf_counter() - start
    resp = out[:, L:]
    is_eos = resp == eos_id
    lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, resp.shape[1])
    return int(lengths.sum()), elapsed


def run_engine(engine, prompts, n, new, topk, seed) -> tuple[int, float]:
    start = time.perf_counter()
    rollouts = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=new, top_k_logprobs=topk, seed=seed))
    elapsed = time.perf_counter() - start
    return sum(int(r.response_ids.numel()) for r in rollouts), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-10m", help="random-10m, tiny-random, smollm2-135m or a folder")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--new", type=int, default=128, help="max new tokens")
    ap.add_argument("--topk", type=int, default=0, help="top-K log-probs recorded by the engine")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fixed-length", action="store_true", help="every response exactly --new tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = build(args.model, dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = prompt_ids(tokenizer, args.prompts, vocab)
    engine = HFEngine(model, tokenizer)
    eos_id, pad_id = min(engine.eos_ids), engine.pad_id
    if args.fixed_length:
        engine.eos_ids = set()  # benchmark only: nothing ends a response before --new tokens
    run_engine(engine, prompts[:2], 1, 4, 0, 0)  # warm-up
    results = {"generate": [], "hf_engine": []}
    for rep in range(args.repeats):
        results["generate"].append(
            run_generate(model, prompts, args.n, args.new, pad_id, eos_id, rep, args.fixed_length))
        results["hf_engine"].append(run_engine(engine, prompts, args.n, args.new, args.topk, rep))
    print(f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, {args.dtype}), "
          f"{args.prompts} prompts x n={args.n}, {'exactly' if args.fixed_length else 'max'} {args.new} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'method':<12}{'tokens':>10}{'seconds':>10}{'tok/s':>10}")
    summary = {}
    for name, runs in results.items():
        tokens, secs = sum(r[0] for r in runs), sum(r[1] for r in runs)
        summary[name] = round(tokens / secs, 1)
        print(f"{name:<12}{tokens:>10}{secs:>10.2f}{tokens / secs:>10.1f}")
    summary["speedup"] = round(summary["hf_engine"] / summary["generate"], 2)
    print(f"speedup {summary['speedup']}x")
    emit({"bench": "hf_generate", "model": args.model, "dtype": args.dtype, "prompts": args.prompts,
          "n": args.n, "new": args.new, "fixed_length": args.fixed_length, "topk": args.topk,
          "threads": torch.get_num_threads(), "tok_s": summary})


if __name__ == "__main__":
    main()
