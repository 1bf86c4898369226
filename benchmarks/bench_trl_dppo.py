"""The cost of DPPO inside TRL: `DPPOTrainer` (dppo.integrations.trl) beside TRL's own `GRPOTrainer`, same settings.

The same model, chain_sum prompts (chat template), prompts x generations, max new tokens, temperature 1, one optimiser
step per generation batch, lr 3e-5 constant, beta 0, fp32, no gradient checkpointing, TRL's default loss_type "dapo":
  grpo       trl.GRPOTrainer (its clipped ratio loss);
  dppo       DPPOTrainer, DPPO-Binary-TV: µ recorded during TRL's transformers generation, the loss `policy_loss`;
  dppo-topk  DPPOTrainer, DPPO-Top-K-TV (K = 20): µ's top-K recorded too, π's cells from one extra lm-head pass;
  dppo-hf    DPPOTrainer, DPPO-Binary-TV with rollout_func=dppo_rollout_func("hf") (dppo's engine generates).
Each (system, repeat) runs in its own child process, the systems interleaved repeat by repeat (ABAB) so that drift
on a shared machine hits all alike. A step's time is the median over `--steps` steps after `--warmup`; per step the
child also times generation + scoring (`_generate_and_score_completions`) and the loss call (`_compute_loss`: the
policy forward, the loss and its metrics); "loss math" is the loss call less the policy forward
(`_get_per_token_logps_and_entropies`).

Step times on a shared 2-core machine drift by more than the 2% to be measured, so one more child measures the loss
itself A/B: grpo, dppo and dppo-topk trainers on identical weights score the SAME generation batch (recorded by the
Top-K trainer; the other two get it without the cells), forward + loss + backward, `--ab-repeats` rounds with the
order rotating each round; medians per system. Targets: dppo within 2% of grpo, in step time and in the A/B.

    nice .venv/bin/python benchmarks/bench_trl_dppo.py                       # random-10m, 4 x 8 x 24, 3 steps
    nice .venv/bin/python benchmarks/bench_trl_dppo.py --model smollm2-135m --prompts 8 --steps 3

Needs trl: `.venv/bin/pip install --no-deps trl==1.16.0`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

from common import LR, child_result, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

SYSTEMS = ("grpo", "dppo", "dppo-topk", "dppo-hf")
TARGET_OVERHEAD = 0.02
"""Largest acceptable (dppo step time / grpo step time) - 1."""


def child(args) -> dict:
    import torch
    from common import chain_sum_examples as examples, model_folder
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from trl import GRPOConfig, GRPOTrainer

    from dppo.integrations.trl import DPPOConfig, DPPOTrainer, dppo_rollout_func

    folder = model_folder(args.model)
    exs, reward = examples(args.prompts * (args.warmup + args.steps))
    data = Dataset.from_list([{"prompt": list(ex.prompt), "index": i} for i, ex in enumerate(exs)])

    def reward_fn(completions, index, **_):
        return [reward(c[0]["content"], exs[i]) for c, i in zip(completions, index)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    common = dict(output_dir=tempfile.mkdtemp(prefix="bench-trl-dppo-"), use_cpu=True, bf16=False,
                  gradient_checkpointing=False, lr_scheduler_type="constant", learning_rate=LR, beta=0.0,
                  num_generations=args.gens, per_device_train_batch_size=args.prompts * args.gens,
                  max_completion_length=args.new, temperature=1.0, max_steps=args.warmup + args.steps,
                  logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                  shuffle_dataset=False)
    kwargs = {}
    if args.system == "grpo":
        config, cls = GRPOConfig(**common), GRPOTrainer
    else:
        topk = args.system == "dppo-topk"
        config = DPPOConfig(**common, trust_region="dppo_topk_tv" if topk else "dppo_binary_tv")
        cls = DPPOTrainer
        if args.system == "dppo-hf":
            kwargs["rollout_func"] = dppo_rollout_func("hf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = cls(model=model, reward_funcs=reward_fn, args=config, train_dataset=data,
                  processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[Clock()], **kwargs)
    phases = {"generate": [], "loss_call": [], "forward": []}
    timed(trainer, "_generate_and_score_completions", phases["generate"])
    timed(trainer, "_compute_loss", phases["loss_call"])
    timed(trainer, "_get_per_token_logps_and_entropies", phases["forward"], only_grad=True)
    trainer.train()
    kept = slice(args.warmup, None)
    out = {"step_s": statistics.median(times[kept]), "generate_s": statistics.median(phases["generate"][kept]),
           "loss_call_s": statistics.median(phases["loss_call"][kept]),
           "loss_math_s": statistics.median(a - b for a, b in zip(phases["loss_call"][kept], phases["forward"][kept])),
           "steps": len(times[kept])}
    return out


def timed(trainer, name: str, sink: list, only_grad: bool = False) -> None:
    """Wrap trainer.<name> to append each call's seconds to `sink` (with grad enabled only, if `only_grad`: the
    policy forward of the loss, not the no-grad scoring forwards)."""
    inner = getattr(trainer, name)

    def wrapper(*a, **k):
        import torch

        if only_grad and not torch.is_grad_enabled():
            return inner(*a, **k)
        t0 = time.perf_counter()
        result = inner(*a, **k)
        sink.append(time.perf_counter() - t0)
        return result

    setattr(trainer, name, wrapper)


def ab_child(args) -> dict:
    """Forward + loss + backward of one generation batch, grpo / dppo / dppo-topk on identical weights, interleaved."""
    import torch
    from common import chain_sum_examples as examples, model_folder
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from trl import GRPOConfig, GRPOTrainer

    from dppo.integrations.trl import DPPOConfig, DPPOTrainer

    folder = model_folder(args.model)
    exs, reward = examples(args.prompts)
    data = Dataset.from_list([{"prompt": list(ex.prompt), "index": i} for i, ex in enumerate(exs)])
    common = dict(output_dir=tempfile.mkdtemp(prefix="bench-trl-dppo-ab-"), use_cpu=True, bf16=False,
                  gradient_checkpointing=False, beta=0.0, num_generations=args.gens,
                  per_device_train_batch_size=args.prompts * args.gens, max_completion_length=args.new,
                  temperature=1.0, report_to="none", save_strategy="no", seed=0, shuffle_dataset=False)
    configs = {"grpo": (GRPOTrainer, GRPOConfig(**common)), "dppo": (DPPOTrainer, DPPOConfig(**common)),
               "dppo-topk": (DPPOTrainer, DPPOConfig(**common, trust_region="dppo_topk_tv"))}
    trainers = {}
    for name, (cls, config) in configs.items():
        trainers[name] = cls(model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                             reward_funcs=lambda completions, index, **_: [reward(c[0]["content"], exs[i])
                                                                           for c, i in zip(completions, index)],
                             args=config, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(folder))
        trainers[name].model.train()
        trainers[name].current_gradient_accumulation_steps = 1
    rows = [dict(data[i]) for i in range(args.prompts) for _ in range(args.gens)]
    batches = {"dppo-topk": trainers["dppo-topk"]._generate_and_score_completions(rows)}
    batches["grpo"] = batches["dppo"] = {k: v for k, v in batches["dppo-topk"].items() if not k.startswith("rollout_topk")}
    samples = {name: [] for name in trainers}
    for r in range(args.ab_repeats + 1):
        names = list(trainers)[r % 3:] + list(trainers)[:r % 3]
        for name in names:
            trainer = trainers[name]
            t0 = time.perf_counter()
            trainer._compute_loss(trainer.model, batches[name]).backward()
            if r:  # the first round warms up
                samples[name].append(time.perf_counter() - t0)
            trainer.model.zero_grad(set_to_none=True)
    tokens = int(batches["grpo"]["completion_mask"].sum())
    return {name: {"median_s": statistics.median(v), "min_s": min(v)} for name, v in samples.items()} | {"tokens": tokens}


def run_child(args, system: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--system", system, "--model", args.model, "--prompts", str(args.prompts),
           "--gens", str(args.gens), "--new", str(args.new), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--ab-repeats", str(args.ab_repeats)]
    t0 = time.perf_counter()
    out = child_result(cmd, system, TRL_EXPERIMENTAL_SILENCE="1")
    what = f"{out['step_s']:.2f} s/step" if "step_s" in out else "A/B on one batch"
    print(f"  {system}: {what} ({time.perf_counter() - t0:.0f} s in all)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-10m", help="random-10m or smollm2-135m (benchmarks/bench_vs_trl.py)")
    p.add_argument("--systems", default="grpo,dppo,dppo-topk,dppo-hf")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="child processes per system, interleaved")
    p.add_argument("--ab-repeats", type=int, default=10, help="rounds of the A/B loss measurement (0 = skip it)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(ab_child(args) if args.system == "ab" else child(args)), flush=True)
        return
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; valid: {', '.join(SYSTEMS)}")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for system in systems:
            runs[system].append(run_child(args, system))
    ab = run_child(args, "ab") if args.ab_repeats else None
    report(args, runs, ab)


def report(args, runs: dict[str, list[dict]], ab: dict | None) -> None:
    keys = ("step_s", "generate_s", "loss_call_s", "loss_math_s")
    rows = {s: {k: statistics.median(r[k] for r in rs) for k in keys} for s, rs in runs.items()}
    base = rows.get("grpo")
    fmt = lambda x: f"{100 * x:+.1f}%" if x is not None else "-"  # noqa: E731
    print(f"\n{args.model}, {args.prompts} prompts x {args.gens} generations, {args.new} new tokens, median of "
          f"{args.steps} steps after {args.warmup} warm-up, median over {args.repeats} interleaved runs, "
          f"{args.threads} threads")
    print(f"{'system':<11}{'s/step':>8}{'vs grpo':>9}{'runs':>16}{'gen+score':>11}{'loss call':>11}{'loss math':>11}")
    summary = []
    for system, r in rows.items():
        over = r["step_s"] / base["step_s"] - 1 if base else None
        each = "/".join(f"{x['step_s']:.2f}" for x in runs[system])
        print(f"{system:<11}{r['step_s']:>8.2f}{fmt(over):>9}{each:>16}{r['generate_s']:>11.2f}{r['loss_call_s']:>11.3f}"
              f"{r['loss_math_s']:>11.4f}")
        summary.append({"system": system, **r, "step_overhead_vs_grpo": over,
                        "step_s_runs": [x["step_s"] for x in runs[system]]})
    checks = {}
    if base and "dppo" in rows:
        checks["dppo_step_overhead_ok"] = rows["dppo"]["step_s"] / base["step_s"] - 1 <= TARGET_OVERHEAD
    if ab:
        print(f"\nA/B, one batch ({ab['tokens']} response tokens), forward + loss + backward, median of "
              f"{args.ab_repeats} interleaved rounds:")
        for name in ("grpo", "dppo", "dppo-topk"):
            over = ab[name]["median_s"] / ab["grpo"]["median_s"] - 1
            ab[name]["overhead_vs_grpo"] = over
            print(f"  {name:<11}{ab[name]['median_s']:>8.3f} s{fmt(over):>9}   (min {ab[name]['min_s']:.3f} s)")
        checks["dppo_loss_overhead_ok"] = ab["dppo"]["overhead_vs_grpo"] <= TARGET_OVERHEAD
    emit({"benchmark": "bench_trl_dppo", "model": args.model, "prompts": args.prompts,
          "generations": args.gens, "new_tokens": args.new, "steps": args.steps, "repeats": args.repeats,
          "threads": args.threads, "results": summary, "ab": ab, "checks": checks})


if __name__ == "__main__":
    main()
