"""1 process vs 2 processes (torchrun, DDP and FSDP2) on the same global batch: step time and peak memory.

Each configuration runs `dppo.train.trainer.Trainer.step` on the same config (P prompts × G responses per step, the hf
engine, no eval): `--warmup` untimed steps, then `--steps` timed ones. Rows:
- 1 process, 1 thread (the speed-up baseline) and 1 process, 2 threads (this machine has 2 cores),
- 2 processes × 1 thread (torchrun, gloo on CPU / nccl on GPU), DDP and FSDP2.
Per row: mean step time (the slowest rank's), its generation / training / weight-sync parts, peak RSS per
process (ru_maxrss), the bytes one engine sync gathers per rank (FSDP2: the full state dict; DDP: none, each rank
holds the full model), and the communication share, estimated as the time of the step's collectives issued
alone on tensors of the same sizes (DDP: one gradient all-reduce per optimiser step; FSDP2: three parameter
all-gathers per micro-batch (the "shared" scoring layout calls each layer twice in forward, then backward), one
gradient reduce-scatter per optimiser step, one full-state gather for the engine sync) divided by the step time.

    nice .venv/bin/python benchmarks/bench_distributed.py                       # tiny model (256 x 4), ~2 min
    nice .venv/bin/python benchmarks/bench_distributed.py --model smollm2-135m --steps 2 --skip-2-threads

With CUDA and one GPU the 2-process rows run both ranks on it (nccl needs one GPU per rank: they are skipped).
Prints a table for people, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def _config(args, strategy: str, threads: int):
    from dppo.train.config import replace
    from dppo.train.presets import get_preset

    model = ({"name": "tiny-random-256x4"} if args.model == "tiny"
             else {"name": args.model})
    return replace(get_preset("smoke"), model=model,
                   rollout={"prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.tokens},
                   train={"steps": args.warmup + args.steps, "mini_batches": 2, "micro_batch_size": 8,
                          "eval_before": False, "distributed": strategy, "threads": threads},
                   log={"report_to": ("none",), "progress": False, "samples_per_step": 0})


def _time_collectives(trainer, n_micro: int, n_opt: int) -> float:
    """Seconds of the step's collectives issued alone, on tensors of the trainer's parameter sizes."""
    import torch
    import torch.distributed as dist

    d = trainer.dist
    if not d.enabled:
        return 0.0
    numel = sum(p.numel() for p in trainer.params)
    full = torch.zeros(numel, device=d.device)
    shard = torch.zeros(-(-numel // d.world_size), device=d.device)
    gathered = torch.zeros(shard.numel() * d.world_size, device=d.device)
    dist.barrier()
    t0 = time.perf_counter()
    if d.strategy == "ddp":
        for _ in range(n_opt):
            dist.all_reduce(full)
    else:
        for _ in range(3 * n_micro + 1):  # per micro-batch: 2 decoder calls in forward + backward; engine sync
            dist.all_gather_into_tensor(gathered, shard)
        for _ in range(n_opt):
            dist.reduce_scatter_tensor(shard, gathered)
    dist.barrier()
    return time.perf_counter() - t0


def worker(args) -> None:
    from dppo.train.trainer import Trainer

    strategy, threads = args.worker_strategy, args.worker_threads
    run = Path(args.out).parent / "run"
    trainer = Trainer(_config(args, strategy, threads), run)
    for _ in range(args.warmup):
        trainer.step()
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step()
        rows.append({"step_s": time.perf_counter() - t0, "generation_s": m["perf/generation_s"],
                     "training_s": m["perf/training_s"], "sync_s": m["perf/sync_s"]})
    local_seqs = args.prompts * args.group // trainer.dist.world_size
    n_micro = -(-local_seqs // 8)  # micro_batch_size 8 over the 2 mini-batches
    comm_s = _time_collectives(trainer, n_micro=max(n_micro, 2), n_opt=2)
    sync_bytes = 0
    if trainer.dist.sharded:
        from dppo.run_files.checkpoint import full_state
        state = full_state(trainer.dist, trainer.model, trainable_only=False, rank0_only=False)
        unique = {t.data_ptr(): t for t in state.values()}  # a tied lm-head is the embedding's tensor, counted once
        sync_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    out = {"rank": trainer.dist.rank, "world": trainer.dist.world_size, "steps": rows, "comm_s": comm_s,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "sync_gather_mb": sync_bytes / 2**20,
           "params_m": sum(p.numel() for p in trainer.params) / 1e6,  # a DTensor's numel is the global one
           "device": str(trainer.device)}
    trainer.close()
    Path(f"{args.out}.{out['rank']}").write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, world: int, strategy: str, threads: int, tmp: Path) -> list[dict]:
    out = tmp / f"{world}-{strategy}-{threads}" / "result.json"
    out.parent.mkdir(parents=True)
    me = [str(Path(__file__).resolve()), "--worker-out", str(out), "--worker-strategy", strategy,
          "--worker-threads", str(threads), "--model", args.model, "--steps", str(args.steps), "--warmup",
          str(args.warmup), "--prompts", str(args.prompts), "--group", str(args.group), "--tokens", str(args.tokens)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)})
    if world == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *me]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:6]}... failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (random, hidden 256, 4 layers) or a model name/folder")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--skip-2-threads", action="store_true", help="leave out the 1-process, 2-thread row")
    p.add_argument("--worker-out", dest="out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.out:
        worker(args)
        return
    import torch

    configs = [(1, "ddp", 1), *([] if args.skip_2_threads else [(1, "ddp", 2)]), (2, "ddp", 1), (2, "fsdp2", 1)]
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        configs = [c for c in configs if c[0] == 1]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, strategy, threads in configs:
            ranks = _run(args, world, strategy, threads, Path(tmp))
            steps = [max(r["steps"][i][k] for r in ranks) for i in range(args.steps) for k in ("step_s",)]
            part = lambda k: sum(max(r["steps"][i][k] for r in ranks) for i in range(args.steps)) / args.steps  # noqa: E731
            step_s = sum(steps) / len(steps)
            results.append({"processes": world, "strategy": strategy if world > 1 else "-", "threads": threads,
                            "step_s": step_s, "generation_s": part("generation_s"), "training_s": part("training_s"),
                            "sync_s": part("sync_s"), "comm_share": max(r["comm_s"] for r in ranks) / step_s,
                            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
                            "sync_gather_mb": ranks[0]["sync_gather_mb"], "device": ranks[0]["device"],
                            "params_m": ranks[0]["params_m"]})
    base = results[0]["step_s"]  # 1 process, 1 thread
    print(f"model {args.model} ({results[0]['params_m']:.2f}M params), global batch {args.prompts} prompts x "
          f"{args.group} responses x <= {args.tokens} tokens, 2 mini-batches; {args.steps} timed steps after "
          f"{args.warmup} warm-up; device {results[0]['device']}")
    print(f"{'processes':>9} {'strategy':>8} {'threads':>7} {'step s':>7} {'gen s':>6} {'train s':>7} {'sync s':>6} "
          f"{'comm %':>6} {'speed-up':>8} {'peak RSS MB/proc':>16} {'sync gather MB':>14}")
    for r in results:
        r["speedup_vs_1proc_1thread"] = base / r["step_s"]
        print(f"{r['processes']:>9} {r['strategy']:>8} {r['threads']:>7} {r['step_s']:>7.3f} {r['generation_s']:>6.3f} "
              f"{r['training_s']:>7.3f} {r['sync_s']:>6.3f} {100 * r['comm_share']:>6.1f} "
              f"{r['speedup_vs_1proc_1thread']:>8.2f} {r['peak_rss_mb']:>16.0f} {r['sync_gather_mb']:>14.2f}")
    emit({"bench": "distributed", "model": args.model, "prompts": args.prompts, "group": args.group,
          "tokens": args.tokens, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
