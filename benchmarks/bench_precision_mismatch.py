"""The training-inference mismatch by precision: trainer (fp32, bf16 autocast, fp16 autocast) x engine (float32,
bfloat16, float16), and the batch-shape effect (issue 34, item 3).

No training. Responses are sampled once from the fp32 model on the demo task's prompts (chain_sum, chat template);
then every engine precision µ (the model's weights cast to that dtype, everything computed in it, as the `hf`
engine and vLLM compute) and every trainer precision π (float32 weights under `torch.autocast` to that dtype, the
lm-head and log-softmax in float32 as dppo's trainer computes them: `dppo.train.scoring.score_batch`) score the
same tokens (teacher forcing). The trainer scores them twice: all rows in one batch, and one row at a time (the
same tokens at another batch shape: other GEMM shapes, other summation orders; verl #6280 measured this on
Qwen2.5-0.5B). Per pair, over the response tokens:

- `out 0.9-1.1`: the share of tokens whose ratio π(a)/µ(a) lies outside [0.9, 1.1] (verl #6280's statistic);
- `binary TV`: the mean of |π(a) − µ(a)|, the binary TV DPPO-Binary-TV compares with δ (`dppo.divergence`);
- `TV>δ`: the share of tokens whose binary TV exceeds δ = 0.15 (the most DPPO-Binary-TV could mask at step 0).

    nice .venv/bin/python benchmarks/bench_precision_mismatch.py            # 16 prompts x 4 samples, 64 new tokens
    .venv/bin/python benchmarks/bench_precision_mismatch.py --quick         # 4 prompts x 2 samples, 24 new tokens

Prints a table for people, then one JSON line with every number. Nothing is timed.
"""

from __future__ import annotations

import copy
import contextlib

import torch

from dppo.runtime.hardware import cpu_name
from dppo.studies.diagnose.mismatch import pair_stats

from common import emit, teacher_forced_setup, teacher_logprobs  # benchmarks/ is on sys.path when run as a script

DELTA = 0.15
ENGINES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRAINERS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def trainer_logprobs(model, ids, attention, autocast, *, rows_per_batch: int) -> torch.Tensor:
    """[N, L-1, V] float32 log-probs as dppo's trainer computes them: the decoder under autocast (None = fp32), the
    final hidden state (float32 under autocast) through the lm-head and log-softmax in float32."""
    parts = []
    context = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None else contextlib.nullcontext
    head = model.get_output_embeddings().weight.float()
    with torch.no_grad():
        for start in range(0, ids.shape[0], rows_per_batch):
            rows = slice(start, start + rows_per_batch)
            with context():
                hidden = model.model(input_ids=ids[rows], attention_mask=attention[rows]).last_hidden_state
            parts.append((hidden[:, :-1].float() @ head.T).log_softmax(-1))
    return torch.cat(parts)


def measure(pi_logp, mu_logp, targets, mask) -> dict:
    """`pair_stats` (the statistics `dppo diagnose --trainer-precision ...` reports) at the sampled tokens."""
    pi_a = pi_logp.gather(-1, targets[..., None]).squeeze(-1)
    mu_a = mu_logp.gather(-1, targets[..., None]).squeeze(-1)
    return pair_stats(pi_a, mu_a, mask, delta=DELTA)


def main() -> None:
    args, prompts, model, ids, attention, mask = teacher_forced_setup(__doc__.split("\n\n")[0])
    targets, mask = ids[:, 1:], mask[:, 1:]
    engines = {name: teacher_logprobs(copy.deepcopy(model).to(dtype), ids, attention) for name, dtype in ENGINES.items()}
    rows = []
    for trainer, autocast in TRAINERS.items():
        for batch, per_batch in (("all", ids.shape[0]), ("1", 1)):
            pi = trainer_logprobs(model, ids, attention, autocast, rows_per_batch=per_batch)
            for engine, mu in engines.items():
                rows.append({"trainer": trainer, "trainer_batch": batch, "engine": engine, **measure(pi, mu, targets, mask)})
            if batch == "1":  # the batch-shape effect alone: the same trainer at batch 1 against itself at batch N
                rows.append({"trainer": trainer, "trainer_batch": "1", "engine": f"{trainer} trainer, batch all",
                             **measure(pi, full, targets, mask)})
            else:
                full = pi
        del pi
    n_tokens = int(mask.sum())
    print(f"{args.model} on {cpu_name()}: {len(prompts)} prompts x {args.samples} samples, {n_tokens} response tokens "
          f"(sampled from the fp32 model; every variant scores the same tokens)")
    print(f"{'trainer':<8}{'batch':>6}  {'engine (µ)':<26}{'out 0.9-1.1':>12}{'binary TV':>11}{'TV>0.15':>9}")
    for r in rows:
        print(f"{r['trainer']:<8}{r['trainer_batch']:>6}  {r['engine']:<26}{r['out_0.9_1.1']:>12.2%}"
              f"{r['binary_tv_mean']:>11.2e}{r['tv_over_delta']:>9.2%}")
    emit({"bench": "precision_mismatch", "model": args.model, "cpu": cpu_name(), "prompts": len(prompts),
          "samples": args.samples, "max_new_tokens": args.max_new_tokens, "response_tokens": n_tokens,
          "delta": DELTA, "pairs": rows})


if __name__ == "__main__":
    main()
