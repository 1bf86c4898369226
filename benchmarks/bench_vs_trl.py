"""dppo vs Hugging Face TRL's `GRPOTrainer`: seconds per RL step, tokens/s and peak memory, side by side.

The same model, the same chain_sum prompts (chat template), the same prompts x generations, max new tokens and
temperature, one optimiser step per rollout batch (or `--mini-batches M` for dppo: M optimiser steps per batch,
the paper's setting), lr 3e-5 constant, no KL term, no gradient checkpointing, fp32 weights with or without
bf16 autocast (`--precisions`), for
  trl   GRPOTrainer, its default loss ("dapo"), `use_cpu`, `bf16` and `gradient_checkpointing` pinned explicitly;
  hf    dppo, DPPO-Binary-TV, the pure-transformers engine;
  vllm  dppo, DPPO-Binary-TV, the vLLM engine.
dppo's engine runs in the trainer's precision (fp32, or bf16 weights when the trainer autocasts to bf16).

Every (model, precision, system) runs in its own child process (a clean peak RSS), one after the other; a step's
time is the median of `--steps` steps after `--warmup`. For dppo the child also measures, on one fresh batch, the
irreducible parts of a step: the engine generating the same prompts alone, plus the model's forward + backward +
optimiser step(s) over the resulting sequences alone (the plain `model(input_ids)` forward and dppo's own forward,
`dppo.train.scoring.score_responses`; the faster counts), each the median of `--parts-repeats` runs (a single run
varied by up to 25% on a shared 2-core machine). `step / parts` is the overhead factor (target <= 1.2).
Targets: vllm >= 2.5x and hf >= 1.5x TRL's response tokens/s on SmolLM2, per precision.

    nice .venv/bin/python benchmarks/bench_vs_trl.py                    # both models, fp32 + bf16, all systems
    nice .venv/bin/python benchmarks/bench_vs_trl.py --quick            # random-10m, fp32, 2 steps
    nice .venv/bin/python benchmarks/bench_vs_trl.py --models smollm2-135m --precisions fp32 --mini-batches 4

`trl` is a benchmark-only dependency: `.venv/bin/pip install --no-deps -r requirements/bench.txt`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from common import LR, chain_sum_examples, child_result, dppo_config, emit, model_folder, peak_rss_gib, plain_logp

TARGETS = {"vllm": 2.5, "hf": 1.5}
"""Smallest acceptable dppo / TRL response-tokens/s ratio on SmolLM2."""
TARGET_OVERHEAD = 1.2
"""Largest acceptable dppo step time / (generation alone + training alone)."""


# --------------------------------------------------------------------------------------------------- TRL
def run_trl(args, folder: str, bf16: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    exs, reward = chain_sum_examples(args.prompts * (args.warmup + args.steps))
    data = Dataset.from_list([{"prompt": ex.prompt, "index": i} for i, ex in enumerate(exs)])

    def reward_fn(completions, index, **_):
        return [reward(c[0]["content"] if isinstance(c, list) else c, exs[i]) for c, i in zip(completions, index)]

    times, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    M = args.mini_batches  # M optimiser steps per generation batch: TRL's steps_per_generation
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, bf16=bf16, gradient_checkpointing=False,
        lr_scheduler_type="constant", learning_rate=LR, beta=0.0, num_generations=args.gens,
        per_device_train_batch_size=args.prompts * args.gens // M, steps_per_generation=M,
        max_completion_length=args.new, temperature=1.0, max_steps=(args.warmup + args.steps) * M, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        shuffle_dataset=False,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    # one rollout batch = M optimiser steps (the first of them generates; with M > 1 TRL also recomputes the
    # old policy's log-probs, which DPPO anchored at the rollout policy does not need)
    per_batch = [sum(times[i:i + M]) for i in range(0, len(times), M)]
    if len(lengths) == len(times):  # one logged mean length per optimiser step
        means = [sum(lengths[i:i + M]) / M for i in range(0, len(lengths), M)]
    else:  # TRL logs the completion metrics per generation batch, not per step, when M > 1
        means = lengths if len(lengths) == len(per_batch) else [sum(lengths) / len(lengths)] * len(per_batch)
    return summarise(args, per_batch, [m * args.prompts * args.gens for m in means])


# --------------------------------------------------------------------------------------------------- dppo
def run_dppo(args, folder: str, engine: str, bf16: bool) -> dict:
    from dppo.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix=f"bench-dppo-{engine}-")
    trainer = Trainer(dppo_config(args, folder, engine, bf16, run_dir), run_dir)
    times, tokens, rows = [], [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        metrics = trainer.step()
        trainer.logger.log_step(trainer.step_idx, metrics)
        times.append(time.perf_counter() - t0)
        tokens.append(metrics["perf/response_tokens"])
        rows.append(metrics)
    out = summarise(args, times, tokens)
    kept = rows[args.warmup:]
    out["breakdown"] = {k[5:-2]: statistics.median(r[k] for r in kept) for k in kept[0]
                        if k.startswith("perf/") and k.endswith("_s") and k not in ("perf/step_s", "perf/tokens_per_s")}
    out.update(irreducible(trainer, args))
    trainer.logger.close()
    trainer.close()
    return out


def irreducible(trainer, args) -> dict:
    """On one fresh batch: the engine generating it alone, then forward + backward + optimiser step(s) over it alone
    (as `train.mini_batches` steps), with the plain full-sequence forward and with dppo's shared-prompt forward."""
    import torch

    from dppo.train.batch import collate
    from dppo.train.scoring import score_responses
    from dppo.train.evaluation import engine_prompts

    cfg = trainer.cfg
    exs = [trainer.train_examples[i] for i in trainer.sampler.next(cfg.rollout.prompts_per_step)]
    prompts = engine_prompts(exs, trainer.tokenizer)
    gen_times = []
    for _ in range(args.parts_repeats):  # the median of several, like the step's own time
        t0 = time.perf_counter()
        rollouts = trainer.engine.generate(prompts, trainer._sampling_params(trainer.step_idx))
        gen_times.append(time.perf_counter() - t0)
    gen_s = statistics.median(gen_times)
    batch = collate(rollouts, pad_id=trainer.pad_id)
    B = batch.response_ids.shape[0]
    adv = torch.randn(B)
    model, opt = trainer.model, trainer.optimizer
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.model.precision == "bf16"
                else torch.autocast("cpu", enabled=False))

    def plain(idx):
        return plain_logp(model, [batch.prompt_ids[i] for i in idx.tolist()], batch.response_ids[idx], trainer.pad_id)

    def shared(idx):
        return score_responses(model, [batch.prompt_ids[i] for i in idx.tolist()], batch.response_ids[idx],
                               batch.response_mask[idx], pad_id=trainer.pad_id).logp

    def train_alone(forward) -> float:
        t0 = time.perf_counter()
        for mb in torch.arange(B).chunk(cfg.train.mini_batches):
            for micro in mb.split(cfg.train.micro_batch_size):
                with autocast:
                    lp = forward(micro)
                mask = batch.response_mask[micro]
                (-(lp * mask * adv[micro, None]).sum() / mask.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    train_alone(shared)  # warm both paths once (allocator, kernels)
    plain_s = train_alone(plain)  # (several times slower: once)
    shared_s = statistics.median(train_alone(shared) for _ in range(args.parts_repeats))
    t0 = time.perf_counter()  # the trainer's own update (loss, trust region, metrics) on the same batch
    trainer._update(batch, adv, None)
    update_s = time.perf_counter() - t0
    return {"gen_alone_s": gen_s, "train_plain_s": plain_s, "train_dppo_forward_s": shared_s,
            "update_same_batch_s": update_s, "parts_s": gen_s + min(plain_s, shared_s)}


def summarise(args, times: list[float], tokens: list[float]) -> dict:
    kept_t, kept_n = times[args.warmup:], tokens[args.warmup:]
    return {"step_s": statistics.median(kept_t), "tokens_per_s": sum(kept_n) / sum(kept_t),
            "response_tokens": statistics.mean(kept_n), "peak_rss_gib": peak_rss_gib(), "steps": len(kept_t)}


# --------------------------------------------------------------------------------------------------- driver
def child(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    folder, bf16 = model_folder(args.model), args.precision == "bf16"
    out = run_trl(args, folder, bf16) if args.system == "trl" else run_dppo(args, folder, args.system, bf16)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args, model: str, precision: str, system: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--precision", precision, "--system", system,
           "--prompts", str(args.prompts), "--gens", str(args.gens), "--new", str(args.new), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--mini-batches", str(args.mini_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    out = child_result(cmd, f"{system} on {model} ({precision})")
    print(f"  {model} {precision} {system}: {out['step_s']:.2f} s/step ({time.perf_counter() - t0:.0f} s in all)",
          flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="random-10m,smollm2-135m")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--systems", default="trl,hf,vllm")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mini-batches", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts-repeats", type=int, default=3,
                   help="the irreducible parts (generation alone, training alone) are the median of this many runs")
    p.add_argument("--quick", action="store_true", help="random-10m, fp32, 2 steps after 1 warm-up")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.models, args.precisions, args.steps = "random-10m", "fp32", 2
    results = []
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            row = {"model": model, "precision": precision}
            for system in args.systems.split(","):
                row[system] = run_child(args, model, precision, system)
            results.append(row)
    report(args, results)


def report(args, results: list[dict]) -> None:
    systems = args.systems.split(",")
    print(f"\n{args.prompts} prompts x {args.gens} generations, {args.new} new tokens, {args.mini_batches} "
          f"mini-batch(es) per batch, median of {args.steps} steps after {args.warmup} warm-up, {args.threads} threads")
    print(f"{'model':<14}{'prec':<6}{'system':<7}{'s/step':>8}{'resp tok/s':>12}{'vs trl':>8}{'peak GiB':>10}"
          f"{'gen alone':>11}{'train alone':>13}{'step/parts':>12}")
    summary = []
    for row in results:
        base = row.get("trl")
        for system in systems:
            r = row[system]
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            parts = r.get("parts_s")
            overhead = r["step_s"] / parts if parts else None
            train_alone = min(r["train_plain_s"], r["train_dppo_forward_s"]) if parts else None
            cells = [f"{ratio:.2f}x" if ratio else "-", f"{r['peak_rss_gib']:.2f}",
                     f"{r['gen_alone_s']:.2f}" if parts else "-", f"{train_alone:.2f}" if parts else "-",
                     f"{overhead:.2f}" if overhead else "-"]
            print(f"{row['model']:<14}{row['precision']:<6}{system:<7}{r['step_s']:>8.2f}{r['tokens_per_s']:>12.1f}"
                  + "".join(f"{c:>{w}}" for c, w in zip(cells, (8, 10, 11, 13, 12))))
            summary.append({"model": row["model"], "precision": row["precision"], "system": system,
                            "speedup_vs_trl": ratio, "step_over_parts": overhead, **r})
    for row in results:
        for system in systems:
            if "breakdown" in row[system]:
                b = row[system]["breakdown"]
                print(f"  {row['model']} {row['precision']} {system} breakdown (s): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in b.items() if v >= 0.005))
    checks = {}
    for s in summary:
        if s["model"] == "smollm2-135m" and s["system"] in TARGETS and s["speedup_vs_trl"] is not None:
            checks[f"{s['system']}_{s['precision']}_speedup_ok"] = s["speedup_vs_trl"] >= TARGETS[s["system"]]
        if s["step_over_parts"] is not None:
            checks[f"{s['model']}_{s['system']}_{s['precision']}_overhead_ok"] = s["step_over_parts"] <= TARGET_OVERHEAD
    emit({"benchmark": "bench_vs_trl", "prompts": args.prompts, "generations": args.gens,
          "new_tokens": args.new, "mini_batches": args.mini_batches, "results": summary, "checks": checks})


if __name__ == "__main__":
    main()
