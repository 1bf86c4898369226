"""Cost of the trust-region math (divergence + mask + loss, given log-probs) against the lm-head.

Target (the "Core math" issue): `policy_loss` forward + backward for each trust region costs < 2% of a
forward + backward of the lm-head on the same tokens. The lm-head side is `dppo.logprobs.fused_logprobs`
(hidden @ W.T -> log-softmax -> gather, chunked, float32) when it exists, else the naive
`(hidden @ W.T).log_softmax(-1).gather(...)` in float32; the table says which. Shapes: N = B·T tokens
(default 16 × 256 = 4096), H = 576 and V = 49152 (SmolLM2-135M).

Variants: dppo_binary_tv, dppo_binary_kl, dppo_topk_tv (the `topk_tv` call on [N, 21] cells is included
in its time), ppo_clip, cppo; each is `policy_loss(...)` + `backward()` to a leaf `logp` [B, T]. The
measurements are interleaved (every round times `--reps` calls of every variant, then one lm-head call);
each number is the fastest single call over all rounds.

    .venv/bin/python benchmarks/bench_tr_overhead.py            # 1-2 min on 2 cores (lm-head 10-25 s a call)
    .venv/bin/python benchmarks/bench_tr_overhead.py --quick    # smaller V, seconds

Prints a table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import time

import torch

from dppo.divergence import topk_tv
from dppo.losses import TokenInputs, loss_spec, policy_loss

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

try:
    from dppo.logprobs import fused_logprobs
except ImportError:  # the fused kernel is written in parallel; fall back to the naive lm-head
    fused_logprobs = None

VARIANTS = ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "ppo_clip", "cppo")
TARGET_PCT = 2.0


def make_inputs(B: int, T: int, H: int, V: int, K: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    N = B * T
    rollout_logp = -torch.rand(B, T, generator=g) * 3
    logp = (rollout_logp + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    cells_mu = torch.log_softmax(torch.randn(N, K + 1, generator=g) * 2, -1) - 0.05  # top-K ∪ {a}, mass < 1
    cells_pi = cells_mu + 0.05 * torch.randn(N, K + 1, generator=g)
    return dict(
        logp=logp.requires_grad_(True), rollout_logp=rollout_logp, adv=torch.randn(B, generator=g),
        mask=torch.arange(T)[None, :] < lengths[:, None],
        cells_pi=cells_pi.clamp(max=0.0), cells_mu=cells_mu, valid=torch.rand(N, K + 1, generator=g) < 0.95,
        hidden=torch.randn(N, H, generator=g).requires_grad_(True),
        weight=(torch.randn(V, H, generator=g) * H**-0.5).requires_grad_(True),
        targets=torch.randint(0, V, (N,), generator=g),
    )


def run_variant(name: str, x: dict) -> None:
    divergence = None
    if name == "dppo_topk_tv":
        divergence = topk_tv(x["cells_pi"], x["cells_mu"], x["valid"]).view_as(x["logp"])
    loss, _ = policy_loss(x["logp"], x["rollout_logp"], x["adv"], x["mask"], loss_spec(trust_region=name),
                          TokenInputs(divergence=divergence))
    loss.backward()
    x["logp"].grad = None


def run_lm_head(x: dict) -> None:
    if fused_logprobs is not None:
        logp = fused_logprobs(x["hidden"], x["weight"], x["targets"]).logp
    else:
        logits = x["hidden"] @ x["weight"].T
        logp = torch.log_softmax(logits.float(), -1).gather(-1, x["targets"][:, None])[:, 0]
    logp.sum().backward()
    x["hidden"].grad = x["weight"].grad = None


def timed(fn, reps: int) -> float:
    """Seconds of the fastest of `reps` calls (on a shared machine the minimum is the least noisy)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=576)
    ap.add_argument("--V", type=int, default=49152)
    ap.add_argument("--K", type=int, default=20, help="top-K; the cells are K+1 wide")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round counts")
    ap.add_argument("--reps", type=int, default=20, help="calls per round of each trust-region variant")
    ap.add_argument("--quick", action="store_true", help="V = 8192, 2 rounds: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.V, args.rounds = 8192, 2

    x = make_inputs(args.B, args.T, args.H, args.V, args.K)
    lm_kind = "fused_logprobs" if fused_logprobs is not None else "naive log_softmax+gather"
    for name in VARIANTS:  # warm-up
        run_variant(name, x)
    run_lm_head(x)

    best = {name: float("inf") for name in (*VARIANTS, "lm_head")}
    for _ in range(args.rounds):
        for name in VARIANTS:
            best[name] = min(best[name], timed(lambda: run_variant(name, x), args.reps))
        best["lm_head"] = min(best["lm_head"], timed(lambda: run_lm_head(x), 1))

    lm_ms = best["lm_head"] * 1e3
    N = args.B * args.T
    print(f"N = {args.B}x{args.T} = {N} tokens, H = {args.H}, V = {args.V}, K = {args.K}; "
          f"threads = {torch.get_num_threads()}; fastest call of {args.rounds} interleaved rounds")
    print(f"lm-head fwd+bwd ({lm_kind}, float32): {lm_ms:.1f} ms")
    print(f"{'variant':<18}{'time ms':>10}{'% of lm-head':>15}")
    rows = {}
    for name in VARIANTS:
        ms = best[name] * 1e3
        rows[name] = {"ms": round(ms, 4), "pct_of_lm_head": round(100 * ms / lm_ms, 4)}
        print(f"{name:<18}{ms:>10.3f}{100 * ms / lm_ms:>14.3f}%")
    worst = max(r["pct_of_lm_head"] for r in rows.values())
    print(f"worst: {worst:.3f}% (target < {TARGET_PCT}%): {'PASS' if worst < TARGET_PCT else 'FAIL'}")
    emit({
        "bench": "tr_overhead", "N": N, "B": args.B, "T": args.T, "H": args.H, "V": args.V, "K": args.K,
        "threads": torch.get_num_threads(), "rounds": args.rounds, "reps": args.reps, "lm_head": lm_kind,
        "lm_head_ms": round(lm_ms, 3), "variants": rows, "worst_pct": worst, "target_pct": TARGET_PCT,
        "pass": worst < TARGET_PCT,
    })


if __name__ == "__main__":
    main()
