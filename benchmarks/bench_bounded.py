"""Bounded calls on pooled threads vs a thread started per call, side by side in one process.

`dppo.runtime.bounded.bounded_calls` runs every environment step, tool call and thread-isolated reward with a time
limit. It used to start a `threading.Thread` per call; `Thread.start()` waits until the new thread runs, and that
handshake costs a GIL hand-off and a scheduler wake-up per call, which torch's busy intra-op threads (or another
process on the cores) stretch from ~50 us to over a millisecond. Now a call is handed to an idle pooled thread.

Two measurements, each alternating the two ways `--repeats` times in the same process (the thread-per-call way is
the old `submit`, patched in for its turns):
- `calls`: `--calls` trivial calls in one batch (all at once, as an episode step hands them over), idle and right
  after a torch matmul (the intra-op threads still spinning);
- `feedback env`: the generation phase of multi-turn training steps on the tiny model (`dppo.train.Trainer`, the
  `feedback` environment: a wrong answer is told to try again, up to 3 turns; `--episodes` episodes a step, the hf
  engine in float32, the tiny model warm-started as tests/train/test_learning.py's feedback test does): the median of the
  steps' `perf/generation_s`; the same seeds each run, so both ways sample the same tokens.

    nice .venv/bin/python benchmarks/bench_bounded.py [--calls 256] [--episodes 256] [--steps 4] [--repeats 3]

Prints a table (median seconds per way, the ratio), then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time

import torch

from common import cpu_name, emit  # benchmarks/ is on sys.path when a benchmark runs as a script

from dppo.runtime import bounded


def thread_per_call(self, fn, i, name, finished: queue.SimpleQueue) -> None:
    """The old way: a new daemon thread per call, started with the `start()` handshake."""

    def run() -> None:
        try:
            finished.put((i, bounded.Outcome("ok", fn())))
        except BaseException as exc:  # noqa: BLE001
            finished.put((i, bounded.Outcome("error", error=exc)))

    threading.Thread(target=run, name=f"{name}-{i}", daemon=True).start()


def both_ways(fn, repeats: int) -> dict[str, list[float]]:
    """fn() timed `repeats` times each way, alternating (the seconds fn returns, if it returns a number)."""
    pooled_submit = bounded._Pool.submit
    times: dict[str, list[float]] = {"pooled": [], "thread per call": []}
    for _ in range(repeats):
        for way in times:
            bounded._Pool.submit = pooled_submit if way == "pooled" else thread_per_call
            try:
                t0 = time.perf_counter()
                seconds = fn()
                times[way].append(seconds if isinstance(seconds, float) else time.perf_counter() - t0)
            finally:
                bounded._Pool.submit = pooled_submit
    return times


def trivial_calls(n: int, after_matmul: bool):
    a = torch.randn(512, 512)

    def run() -> None:
        if after_matmul:
            (a @ a).sum()
        out = bounded.bounded_calls([lambda i=i: i * 2 for i in range(n)], 30.0)
        assert [o.value for o in out] == [2 * i for i in range(n)]

    return run


def feedback_steps(episodes: int, steps: int):
    """`steps` training steps of the feedback environment (episodes x up to 3 turns) on the warm tiny model, as
    tests/train/test_learning.py's feedback test runs them (hf engine, float32); returns the median generation seconds."""
    import json
    import tempfile
    from pathlib import Path

    from dppo.envs import make_environment
    from dppo.runtime.models import char_tokenizer, save_model, tiny_random_model
    from dppo.train.sft import agent_sft
    from dppo.tasks import make_task
    from dppo.train.config import Config, replace
    from dppo.train.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="bench-bounded-"))
    tok = char_tokenizer()
    task = make_task("addition", digits=1, size=80, eval_size=20, seed=0)
    model = tiny_random_model(tok, hidden_size=128, num_layers=2, seed=0)
    agent_sft(model, tok, make_environment("feedback"), list(task.train), steps=40, batch_size=64, lr=3e-3, seed=0)
    save_model(model, tok, root / "model")
    runs = iter(range(10**6))

    def run() -> float:
        run_dir = root / f"run{next(runs)}"
        cfg = replace(Config(), model={"name": str(root / "model"), "precision": "fp32"},
                      rollout={"episodes": "env", "engine": "hf", "dtype": "float32", "prompts_per_step": episodes // 8, "group_size": 8,
                               "max_new_tokens": 4},
                      task={"name": "addition", "options": '{"digits": 1}', "size": 80, "eval_size": 0},
                      env={"name": "feedback", "max_turns": 3, "max_tokens": 160},
                      train={"steps": steps, "eval_before": False},
                      log={"run_dir": str(run_dir), "report_to": ("none",), "progress": False, "samples_per_step": 0})
        with Trainer(cfg, run_dir) as trainer:
            trainer.train()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return statistics.median(r["perf/generation_s"] for r in rows)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=256)
    p.add_argument("--episodes", type=int, default=256, help="episodes per step (8 per prompt)")
    p.add_argument("--steps", type=int, default=4, help="training steps per feedback run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cases = {f"{args.calls} trivial calls": trivial_calls(args.calls, False),
             f"{args.calls} trivial calls after a matmul": trivial_calls(args.calls, True),
             f"feedback env: generation s per step (median of {args.steps}), {args.episodes} episodes":
                 feedback_steps(args.episodes, args.steps)}
    rows = {}
    for label, fn in cases.items():
        fn()  # warm-up (threads, caches)
        times = both_ways(fn, args.repeats)
        med = {way: statistics.median(ts) for way, ts in times.items()}
        rows[label] = {"pooled_s": med["pooled"], "thread_per_call_s": med["thread per call"],
                       "ratio": med["thread per call"] / med["pooled"]}
    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    print("| case | pooled (median s) | thread per call (median s) | thread per call / pooled |")
    print("|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['pooled_s']:.4f} | {r['thread_per_call_s']:.4f} | {r['ratio']:.2f}x |")
    emit({"benchmark": "bench_bounded", "repeats": args.repeats, "cases": rows})


if __name__ == "__main__":
    main()
