"""The trainer's forward + backward over a GRPO batch: the packed layout vs the shared-KV layout vs a plain forward.

SmolLM2-135M (or the random 10M model), P chain_sum chat prompts x G responses with lengths drawn uniformly from
[--min-len, --new] (padded to --new, as a rollout batch of mixed lengths is), gradient of the mean log-prob:
  packed  `score_responses(layout="packed")`: one row per prompt, responses back to back, block attention mask;
  shared  `score_responses(layout="shared")`: prompts once with a KV cache shared by their padded responses;
  plain   `model(input_ids).logits` over each whole padded sequence, full log-softmax, gather (what most RL
          trainers do).
Modes alternate within each round; the table shows medians over `--repeats` rounds and ratios to `packed` as medians
of per-round ratios. Prints a table, then one JSON line.

    nice .venv/bin/python benchmarks/bench_scoring.py
    nice .venv/bin/python benchmarks/bench_scoring.py --model random-10m --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import chain_sum_options, emit, model_folder, plain_logp
from dppo.runtime.models import load_model, load_tokenizer, resolve_model_path
from dppo.train.scoring import score_responses
from dppo.tasks import make_task


def build(args):
    if args.model == "random-10m":
        path = model_folder("random-10m")
    else:
        path = resolve_model_path(args.model)
    tokenizer, model = load_tokenizer(path), load_model(path)
    model.train()
    task = make_task("chain_sum", size=200, eval_size=16, **chain_sum_options())
    prompts = []
    for ex in list(task.train)[:args.prompts]:
        enc = tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(torch.tensor(enc["input_ids"]))
    gen = torch.Generator().manual_seed(0)
    B, T = args.prompts * args.gens, args.new
    response = torch.randint(100, len(tokenizer) - 1, (B, T), generator=gen)
    lengths = torch.randint(args.min_len, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return model, [prompts[i // args.gens] for i in range(B)], response, mask


def run(mode, model, prompt_ids, response, mask) -> float:
    t0 = time.perf_counter()
    if mode == "plain":
        logp = plain_logp(model, prompt_ids, response)
    else:
        logp = score_responses(model, prompt_ids, response, mask, layout=mode).logp
    ((logp * mask).sum() / mask.sum()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, prompt_ids, response, mask = build(args)
    modes = ("packed", "shared", "plain")
    for mode in modes:  # warm-up
        run(mode, model, prompt_ids, response, mask)
    times = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            times[mode].append(run(mode, model, prompt_ids, response, mask))
    tokens = int(mask.sum())
    print(f"{args.model}: {args.prompts} prompts x {args.gens} responses, {tokens} response tokens "
          f"(lengths {args.min_len}-{args.new}, padded to {args.new}), forward + backward, {args.threads} threads")
    print(f"{'layout':<8}{'median s':>10}{'vs packed':>11}")
    rows = []
    for mode in modes:
        ratio = statistics.median(t / p for t, p in zip(times[mode], times["packed"]))
        print(f"{mode:<8}{statistics.median(times[mode]):>10.2f}{ratio:>10.2f}x")
        rows.append({"layout": mode, "median_s": statistics.median(times[mode]), "vs_packed": ratio})
    emit({"benchmark": "bench_scoring", "model": args.model, "prompts": args.prompts, "gens": args.gens,
          "new": args.new, "response_tokens": tokens, "results": rows})


if __name__ == "__main__":
    main()
