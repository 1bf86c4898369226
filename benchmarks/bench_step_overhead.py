"""Why does a step's training phase cost more than the same update alone? Four timings of `Trainer._update`, side by
side in one process, that separate the candidate causes:

  A  in the step           the step's own update: a new batch, right after the engine generated it
  B  same batch again      the same batch once more, right after A (shapes seen, no generation in between)
  C  old batch after gen   the engine generates the next batch, then the previous batch is updated again
                           (shapes seen, right after a generation)
  D  new batch, not after  the next batch updated after C, i.e. new shapes but not right after a generation

A ≫ B with C ≈ B and D ≈ A says new shapes cost (kernel/primitive set-up per shape); C ≈ A says the generation
leaves state that slows the next update (allocator, caches, threads). `step/parts` = the step over (generation
alone + the update alone), as `bench_vs_trl.py` reports it.

The trust-region ledger's cost (issue 52, `dppo.train.step_ledger`): the time of the ledger's own work on the step's
batch, exactly as the trainer calls it — every micro-batch's terms with π_old given (the drift split and the masked
mass by source: the ledger's largest form, when the run recomputes π_old), their sum over the step and the step's
group terms — against the step (`ledger/step`). π_old and π are computed first, untimed: the recompute is the
run's own forward, not the ledger's. Beside it, the opt-in gradient SNR (`log.grad_snr`): the time of one
`GradientNoise.add` (a float32 sum over every trainable parameter, once per optimiser step) and of its `pop` at the
step's end (`snr ms`, for one optimiser step), and the collapse warning's per-step work (`CollapseWatch.update`
with the step's metrics, `watch ms`).

    nice .venv/bin/python benchmarks/bench_step_overhead.py                       # SmolLM2-135M, fp32, hf engine
    nice .venv/bin/python benchmarks/bench_step_overhead.py --model random-10m --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import dppo_config, emit, model_folder, timed  # noqa: E402

import torch  # noqa: E402

from dppo.rollout.source import stamp  # noqa: E402
from dppo.train.batch import collate  # noqa: E402
from dppo.run_files.collapse_watch import CollapseWatch  # noqa: E402
from dppo.train.optim import GradientNoise  # noqa: E402
from dppo.train.step_ledger import LedgerSums, micro_terms, step_terms  # noqa: E402
from dppo.train.trainer import Trainer  # noqa: E402


class _Keep(Trainer):
    """Keeps the batch and advantages of the step's own update."""

    def _update(self, batch, adv, old, timer=None):
        self.last = (batch, adv)
        return super()._update(batch, adv, old, timer)


def ledger_seconds(trainer: Trainer, batch, adv, repeats: int = 5) -> float:
    """The median time of the ledger's work on `batch` over `repeats` (see the module docstring)."""
    old = trainer._recompute(batch).logp  # π_old (and, unchanged, π): the run's forward, untimed
    keep = batch.loss_mask.clone()
    micros = torch.arange(batch.response_ids.shape[0], device=trainer.device).split(trainer.cfg.train.micro_batch_size)
    stale, reward = batch.staleness, batch.reward  # (single answers: one row per episode)

    def once() -> None:
        sums = LedgerSums()
        for m in micros:
            sums.add(micro_terms(keep[m], old[m], batch.rollout_logp[m], adv[m], batch.loss_mask[m], old_logp=old[m],
                                 staleness=stale[m], rewards=reward[m]))
        sums.result()
        step_terms(reward, adv, trainer.cfg.rollout.group_size)

    return statistics.median(timed(once) for _ in range(repeats))


def snr_seconds(trainer: Trainer, repeats: int = 3) -> float:
    """The median time of one optimiser step's `GradientNoise.add` plus the step's `pop` (gradients: random, as
    the sum does not care)."""
    for p in trainer.params:
        p.grad = torch.randn_like(p)
    noise = GradientNoise(trainer.params, trainer.dist)
    norm = trainer.dist.grad_norm(trainer.params)
    noise.add(norm)  # (allocates the sum once, as a run's first step does)
    noise.add(norm)
    noise.pop()

    def once() -> None:
        noise.add(norm)
        noise.add(norm)
        noise.pop()

    seconds = statistics.median(timed(once) for _ in range(repeats)) / 2
    for p in trainer.params:
        p.grad = None
    return seconds


def watch_seconds(metrics: dict, steps: int = 200) -> float:
    """The mean time of `CollapseWatch.update` over `steps` steps of `metrics`."""
    watch = CollapseWatch()
    plain = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    return timed(lambda: [watch.update(s, plain) for s in range(1, steps + 1)]) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engine", default="hf")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--mini-batches", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.warmup = 1
    torch.set_num_threads(args.threads)
    run_dir = tempfile.mkdtemp(prefix="bench-overhead-")
    trainer = _Keep(dppo_config(args, model_folder(args.model), args.engine, args.precision == "bf16", run_dir), run_dir)
    rows = []
    trainer.step()  # warm-up
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step()
        step_s = time.perf_counter() - t0
        batch, adv = trainer.last
        row = {"step_s": step_s, "gen_s": m["perf/generation_s"], "A_in_step_s": m["perf/training_s"]}
        row["B_same_again_s"] = timed(lambda: trainer._update(batch, adv, None))
        draw = trainer._draw(trainer.step_idx)
        t0 = time.perf_counter()
        collect = trainer.source.episodes.collector()
        rollouts = stamp(collect(trainer.engine, draw.examples, draw.params), trainer.step_idx)
        row["gen_alone_s"] = time.perf_counter() - t0
        row["C_old_after_gen_s"] = timed(lambda: trainer._update(batch, adv, None))
        new = collate(rollouts, pad_id=trainer.pad_id).to(trainer.device)
        new.staleness = torch.zeros(new.response_ids.shape[0], dtype=torch.long, device=trainer.device)
        new_adv = torch.randn(new.response_ids.shape[0], device=trainer.device)
        row["D_new_not_after_gen_s"] = timed(lambda: trainer._update(new, new_adv, None))
        row["ledger_s"] = ledger_seconds(trainer, batch, adv)
        row["snr_s"] = snr_seconds(trainer)
        row["watch_s"] = watch_seconds(m)
        row["response_T"] = int(batch.response_ids.shape[1])
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    trainer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    parts = med["gen_alone_s"] + med["B_same_again_s"]
    print(f"\n{args.model} {args.precision} engine {args.engine}, {args.prompts}x{args.gens}, {args.new} new tokens, "
          f"{args.threads} threads, median of {args.steps} steps")
    print(f"{'step':>8}{'gen':>8}{'A step':>9}{'B again':>9}{'C after gen':>13}{'D new shapes':>14}{'step/parts':>12}"
          f"{'ledger ms':>11}{'ledger/step':>13}{'snr ms':>9}{'snr/step':>10}{'watch ms':>10}")
    print(f"{med['step_s']:>8.2f}{med['gen_s']:>8.2f}{med['A_in_step_s']:>9.2f}{med['B_same_again_s']:>9.2f}"
          f"{med['C_old_after_gen_s']:>13.2f}{med['D_new_not_after_gen_s']:>14.2f}{med['step_s'] / parts:>12.2f}"
          f"{1000 * med['ledger_s']:>11.1f}{med['ledger_s'] / med['step_s']:>13.2%}{1000 * med['snr_s']:>9.1f}"
          f"{med['snr_s'] / med['step_s']:>10.2%}{1000 * med['watch_s']:>10.3f}")
    emit({"model": args.model, "precision": args.precision, "engine": args.engine, **med,
          "step_over_parts": med["step_s"] / parts, "A_over_B": med["A_in_step_s"] / med["B_same_again_s"],
          "ledger_over_step": med["ledger_s"] / med["step_s"], "snr_over_step": med["snr_s"] / med["step_s"],
          "watch_over_step": med["watch_s"] / med["step_s"]})


if __name__ == "__main__":
    main()
