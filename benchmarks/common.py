"""What the benchmarks share: the model folder, the prompts, timing, child processes and the final JSON line.

Every benchmark in this folder imports what it shares from here (`from common import ...`: benchmarks/ is on
sys.path when a benchmark runs as a script), and no benchmark imports another.

- `model_folder(name)`: a local folder with a model and its tokenizer (`random-10m`, cached; `smollm2-135m`);
- `chain_sum_examples(count)`: the demo's chain_sum prompts (two one-digit terms) and their reward;
  `QUESTIONS`: sixteen chat questions of mixed length (the generation benchmarks);
- `dppo_config(args, ...)`: dppo's demo run at the shape of a TRL comparison (`--prompts`, `--gens`, `--new`, ...);
- `plain_logp(model, ...)`: log π the way most RL trainers get it (a plain forward over each whole sequence);
- `timed(fn)`: wall seconds of one call; `peak_rss_gib()`: this process's peak resident memory;
- `demo_steps(...)`: `dppo train --preset demo` in its own process, its metric rows;
  `child_result(cmd, label)`: a benchmark child process's `RESULT {json}` line;
- `train_arm(cfg, out)`: one training run with evaluation before and after, summarised (the learning benchmarks);
- `emit(payload)`: the one JSON line a benchmark ends with.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (benchmark children run from it)."""
LR = 3e-5
"""The learning rate of the dppo-vs-TRL comparisons (constant)."""

QUESTIONS = [
    "What is 17 + 25?", "Name three primary colours.", "Write a haiku about the sea.", "What is 9 times 8?",
    "Explain what a prime number is.", "Give me a synonym for happy.", "What is the capital of France?",
    "Sum the numbers 3, 5 and 11.", "Describe a cat in one sentence.", "What is 144 divided by 12?",
    "List two fruits that are red.", "How many legs does a spider have?", "What comes after Tuesday?",
    "Translate 'good morning' into French.", "What is 2 to the power of 10?", "Why is the sky blue?",
]
"""Chat questions of mixed length, the same prompts in every generation benchmark."""


def model_folder(name: str) -> str:
    """A local folder holding the model and a tokenizer (TRL and dppo both load it by path): `smollm2-135m`, or
    `random-10m` (~10M parameters with SmolLM2's tokenizer, vocab 49152, tied; built once into the cache)."""
    from dppo.runtime.models import cache_dir, load_tokenizer, resolve_model_path, save_model, tiny_random_model

    smollm2 = resolve_model_path("smollm2-135m")
    if name == "smollm2-135m":
        return str(smollm2)
    if name != "random-10m":
        raise SystemExit(f"--models: unknown model {name!r} (random-10m, smollm2-135m)")
    folder = cache_dir() / "bench-random-10m"
    if not (folder / "config.json").is_file():
        tokenizer = load_tokenizer(smollm2)
        model = tiny_random_model(tokenizer, hidden_size=160, num_layers=6, num_heads=5, num_kv_heads=5,
                                  intermediate_size=512, seed=0)
        save_model(model, tokenizer, folder)
    return str(folder)


def chain_sum_options() -> dict:
    """The demo's task options: chain_sum with two one-digit terms."""
    from dppo.train.presets import CHAIN_SUM_EASY

    return json.loads(CHAIN_SUM_EASY)


def chain_sum_examples(count: int):
    """The first `count` training examples of the demo's chain_sum task (200 questions, 16 held out) and its reward."""
    from dppo.tasks import make_task

    task = make_task("chain_sum", size=200, eval_size=16, **chain_sum_options())
    return list(task.train)[:count], task.reward


def dppo_config(args, folder: str, engine: str, bf16: bool, run_dir: str):
    """dppo's demo preset at a comparison's shape: DPPO-Binary-TV, `args.prompts` x `args.gens`, `args.new` new
    tokens, lr `LR`, `args.warmup + args.steps` steps, no evaluation; bf16 autocast and a bf16 engine when `bf16`."""
    from dppo.train.config import replace
    from dppo.train.presets import demo

    return replace(
        demo(),
        model={"name": folder, "dtype": "float32", "precision": "bf16" if bf16 else "fp32"},
        rollout={"engine": engine, "dtype": "bfloat16" if bf16 else "float32", "prompts_per_step": args.prompts,
                 "group_size": args.gens, "max_new_tokens": args.new, "temperature": 1.0},
        loss={"trust_region": "dppo_binary_tv"},
        optim={"lr": LR},
        train={"steps": args.warmup + args.steps, "mini_batches": args.mini_batches,
               "micro_batch_size": args.micro_batch_size, "eval_before": False, "threads": args.threads},
        log={"run_dir": run_dir, "progress": False},
    )


def plain_logp(model, prompt_ids, response, pad_id: int = 0):
    """log π of the [B, T] (padded) responses the way most RL trainers get it: each prompt + response sequence
    left-padded and run whole, logits at the response positions, full log-softmax, gather."""
    import torch

    seqs = [torch.cat([p, r]) for p, r in zip(prompt_ids, response)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], att[i, width - len(s):] = s, 1
    T = response.shape[1]
    logits = model(input_ids=ids, attention_mask=att).logits[:, -T - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, response[..., None]).squeeze(-1)


def teacher_forced_setup(description: str):
    """The set-up the teacher-forcing mismatch benchmarks share: their flags parsed (--model, --prompts, --samples,
    --max-new-tokens, --seed, --quick = 4 prompts x 2 samples, 24 new tokens), then the fp32 model and responses it
    sampled on the demo task's prompts. Returns (args, prompts, model, ids, attention, mask)."""
    import argparse

    import torch

    from dppo.runtime.models import load_model, load_tokenizer
    from dppo.train.build import build_task
    from dppo.train.presets import get_preset

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or a local folder")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 prompts x 2 samples, 24 new tokens")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens = 4, 2, 24
    prompts = [ex.prompt for ex in build_task(get_preset("demo")).train_examples()[: args.prompts]]
    model = load_model(args.model, dtype=torch.float32)
    ids, attention, mask = sample_responses(model, load_tokenizer(args.model), prompts, args.samples,
                                            args.max_new_tokens, args.seed)
    return args, prompts, model, ids, attention, mask


def sample_responses(model, tokenizer, prompts, samples: int, max_new_tokens: int, seed: int):
    """`samples` responses per chat prompt sampled from `model` (temperature 1, no truncation): token ids [N, L]
    (left-padded prompt + response), attention [N, L], the response mask [N, L] (EOS included)."""
    import torch

    texts = [tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    enc = tokenizer([t for t in texts for _ in range(samples)], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    response = out[:, prompt_len:]
    is_eos = response == tokenizer.eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = torch.zeros_like(out, dtype=torch.bool)
    mask[:, prompt_len:] = ~after_eos
    attention = torch.cat([enc["attention_mask"], (~after_eos).long()], dim=1)
    return out, attention, mask


def teacher_logprobs(model, ids, attention):
    """Full-vocabulary log-probs in fp32 for predicting ids[:, 1:], [N, L-1, V] (the model in its own dtype)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    return logits.log_softmax(-1)


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of `fn`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_rss_gib() -> float:
    """This process's peak resident memory in GiB (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def demo_steps(label: str, extra: list[str], steps: int, out: Path) -> tuple[list[dict], float]:
    """Run `dppo train --preset demo` for `steps` steps without evaluation, with `extra` flags, in its own process;
    returns the metrics rows of steps 2.. (the first step, start-up, left out) and the wall seconds."""
    cmd = [sys.executable, "-m", "dppo.cli", "train", "--preset", "demo", "--run-dir", str(out),
           "--train.steps", str(steps), "--train.no-eval-before", "--task.eval-size", "0", "--log.no-progress",
           "--log.report-to", "none", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:], wall


def child_result(cmd: list[str], label: str, **env: str) -> dict:
    """Run a benchmark child process and return the JSON of its last `RESULT ` line (its output on failure)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    return json.loads(lines[-1][7:])


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere), to print beside a time."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def train_arm(cfg, out: Path) -> dict:
    """Train `cfg` (its train.eval_before set) into `out`: held-out results before and after, wall seconds, median
    step and generation seconds, the training reward, tool calls and episode errors per step."""
    from dppo.train.trainer import Trainer

    t0 = time.perf_counter()
    with Trainer(cfg, out) as trainer:
        results = trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"before": results["eval_before"], "after": results["eval_after"], "wall_s": time.perf_counter() - t0,
            "step_s": sorted(r["perf/step_s"] for r in rows)[len(rows) // 2],
            "generation_s": sorted(r["perf/generation_s"] for r in rows)[len(rows) // 2],
            "training_reward": [round(r["reward/mean"], 3) for r in rows],
            "tool_calls": [round(r.get("episode/tool_calls_mean", 0.0), 2) for r in rows],
            "episode_errors": sum(r.get("episode/env_errors", 0) for r in rows)}


def emit(payload: dict, **dumps) -> None:
    """Print the benchmark's final line: `payload` as one line of JSON (`dumps`: json.dumps options)."""
    print(json.dumps(payload, **dumps), flush=True)
