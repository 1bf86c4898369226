"""How far low-precision rollout engines are from the fp32 trainer on a real model: bf16 and fp8 (issue 14).

The sanity study's 0.31M-parameter character model showed fp8 rollouts as a small mismatch (mean |π − µ| ≤ 0.012):
its weights are small and its logits flat. This measures the same engines on SmolLM2-135M-Instruct (the offline
model of the demo), with no training: responses are sampled from the fp32 model π on the demo task's prompts
(chain_sum, chat template), then every engine variant µ scores the same tokens (teacher forcing) and the
per-token divergences between µ and π are averaged over response tokens:

- |π(a) − µ(a)| of the sampled token a, its mean and 99th percentile: the sanity study's mismatch, and equal to the
  binary TV (`dppo.divergence.binary_tv`, sampled token vs the rest) that DPPO-Binary-TV compares with δ;
- the exact TV over the vocabulary (`dppo.divergence.full_tv`), mean and max;
- the share of tokens whose exact TV exceeds DPPO's δ = 0.15 (the trust region would mask them at step 0).

Engine variants (what `rollout.dtype` / `rollout.quantization` / `rollout.hf.fp8_activations` build):
bf16 (weights and compute in bf16), fp8-w (`dppo.rollout.quantize.fp8_weights`: e4m3, one scale per output channel,
fp32 compute), fp8-w bf16 (fp8 weights, bf16 compute: what an fp8 engine with bf16 activations computes) and
fp8-w+a (fp8 weights and per-token fp8 inputs to every decoder linear layer). No time is measured.

    nice .venv/bin/python benchmarks/bench_fp8_mismatch.py                 # 16 prompts x 4 samples, 64 new tokens
    .venv/bin/python benchmarks/bench_fp8_mismatch.py --quick              # 4 prompts x 2 samples, 24 new tokens

Prints a table for people, then one JSON line with every number.
"""

from __future__ import annotations

import copy

import torch

from dppo.divergence import full_tv
from dppo.rollout.quantize import add_fp8_activation_hooks, fp8_weights

from common import emit, teacher_forced_setup, teacher_logprobs  # benchmarks/ is on sys.path when a benchmark runs as a script

DELTA = 0.15


def variants(model):
    """(name, engine model) for every rollout precision measured; each is a separate copy of `model`."""
    state = model.state_dict()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fp8_w = copy.deepcopy(model)
    fp8_w.load_state_dict(fp8_weights(state))
    fp8_w_bf16 = copy.deepcopy(fp8_w).to(torch.bfloat16)
    fp8_wa = copy.deepcopy(fp8_w)
    add_fp8_activation_hooks(fp8_wa)
    return [("bf16", bf16), ("fp8-w", fp8_w), ("fp8-w bf16", fp8_w_bf16), ("fp8-w+a", fp8_wa)]


def measure(pi_logp, mu_logp, targets, mask) -> dict:
    """Divergences of µ from π over the response tokens (mask)."""
    pi_a = pi_logp.gather(-1, targets[..., None]).squeeze(-1)[mask]
    mu_a = mu_logp.gather(-1, targets[..., None]).squeeze(-1)[mask]
    gap = (pi_a.exp() - mu_a.exp()).abs()
    tv = full_tv(pi_logp[mask], mu_logp[mask])
    return {"mean_abs_gap": gap.mean().item(), "p99_abs_gap": gap.quantile(0.99).item(),
            "tv_mean": tv.mean().item(), "tv_max": tv.max().item(),
            "tv_over_delta": (tv > DELTA).float().mean().item()}


def main() -> None:
    args, prompts, model, ids, attention, mask = teacher_forced_setup(__doc__.split("\n\n")[0])
    targets, mask = ids[:, 1:], mask[:, 1:]
    pi_logp = teacher_logprobs(model, ids, attention)
    n_tokens = int(mask.sum())
    rows = {name: measure(pi_logp, teacher_logprobs(engine, ids, attention), targets, mask)
            for name, engine in variants(model)}
    print(f"{args.model}: {len(prompts)} prompts x {args.samples} samples, {n_tokens} response tokens "
          f"(sampled from the fp32 model; every engine scores the same tokens)")
    head = f"{'engine':<12}{'mean|pi-mu|':>12}{'p99|pi-mu|':>12}{'TV mean':>10}{'TV max':>9}" \
           f"{'TV>0.15':>9}"
    print(head)
    for name, r in rows.items():
        print(f"{name:<12}{r['mean_abs_gap']:>12.4f}{r['p99_abs_gap']:>12.4f}"
              f"{r['tv_mean']:>10.4f}{r['tv_max']:>9.3f}{r['tv_over_delta']:>9.2%}")
    emit({"bench": "fp8_mismatch", "model": args.model, "prompts": len(prompts), "samples": args.samples,
          "max_new_tokens": args.max_new_tokens, "response_tokens": n_tokens, "delta": DELTA,
          "engines": rows})


if __name__ == "__main__":
    main()
