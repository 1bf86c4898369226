"""Running the study: the shared warm start, each (method, seed) run's trainer config, and `dppo sanity` itself.

Set-up: a tiny character-level Qwen2 is warm-started by supervised training (`dppo.studies.sft`) on the built-in
`addition` task to a low but nonzero accuracy, saved once (cached by its arguments, task and task options
included), and every (method, seed) run starts from that identical folder. `--task reverse` uses the built-in
`reverse` task instead (`dppo.tasks.reverse`: answers of `--min-len`..`--max-len` = 16..20 digits, so responses
of >= 16 tokens where addition's are <= 4; the mismatch term grows with the response length). Its warm start has
its own defaults (`TASK_DEFAULTS`: 215 SFT steps of batch 32, which memorise its 80 training strings to a sampled
accuracy of ~0.2) and `max_new_tokens` is max_len + 2 (the answer, EOS and one token of slack).

Rollouts are sampled by the HF engine in **bf16** (`--engine-dtype`) while the trainer holds **fp32** weights (a
real training–inference mismatch), and every rollout batch is split into `mini_batches` (default 4) optimiser
steps, so later mini-batches are off-policy. All methods get the same lr, batch and steps; only the `loss` section
differs (`dppo.studies.sanity.methods`).

Outputs in the out-dir: one run folder per (method, seed), `sanity.json` (settings = the resolved `SanityConfig`
plus the task options, the engine, the trainer dtype and the warm-start folder; the criteria; per-method summary,
per-seed summaries and curves), `sanity.png` and a printed table (`dppo.studies.sanity.summary`); the time of
every (method, seed) run is printed as it finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from dppo.envs import make_environment
from dppo.runtime.models import char_tokenizer, save_model, tiny_random_model
from dppo.studies.sanity.config import TASK_DEFAULTS, SanityConfig, parse_args, task_options
from dppo.studies.sanity.methods import method_loss, run_name
from dppo.studies.sanity.noise import NoisyRolloutTrainer
from dppo.studies.sanity.report import cmd_report
from dppo.studies.sanity.warning import main as cmd_warning
from dppo.studies.sanity.summary import (CRITERIA, CURVE_KEYS, curves, fmt, format_table, plot_sanity, summarize_method,
                                         summarize_run)
from dppo.studies.sft import sft_warm_start
from dppo.tasks import make_task
from dppo.train.config import Config, replace
from dppo.train.plot import read_metrics
from dppo.train.sft import agent_sft
from dppo.train.trainer import Trainer

MICRO_BATCH_SIZE = 64
"""Sequences per forward/backward pass of the trainer (a memory knob; the loss does not depend on it)."""
EPISODE_TOKENS_PER_TURN = 56
"""--env: an episode's token budget per turn (its answer, the environment's retry message of ~40 characters and the
chat template's markers, in characters: 3 turns fit in 168 tokens)."""
TASK_SEED = 0
"""The task's seed: the same training and held-out split for every run and the warm start."""


def _task_and_options(task: str, options: dict[str, Any] | None, digits: int) -> dict[str, Any]:
    if options is None:
        return task_options(task, digits=digits)
    task_options(task)  # checks the name
    return dict(options)


def warm_start(out_dir: str | Path, *, seed: int = 0, hidden: int = 128, layers: int = 2, sft_steps: int | None = None,
               digits: int = 1, size: int = 80, eval_size: int = 20, batch_size: int | None = None, lr: float = 3e-3,
               task_seed: int = TASK_SEED, task: str = "addition", options: dict[str, Any] | None = None,
               env: str = "none") -> Path:
    """A supervised warm start of a tiny char-level Qwen2 (head size 32) on `task` ("addition" with `digits`, or
    "reverse"; `options` replaces the task's options, default `task_options(task, digits=digits)`), saved to
    `out_dir/warm-<hash of the arguments, task and options included>/` and reused when that folder already holds a
    model. `sft_steps` / `batch_size` default to the task's `TASK_DEFAULTS`. With `env` (a `dppo.envs` name, e.g.
    "feedback") the SFT is `dppo.train.sft` on that environment's demonstrations: the chat layout of its
    episodes, as RL sees them."""
    options = _task_and_options(task, options, digits)
    defaults = TASK_DEFAULTS[task]
    sft_steps = defaults["sft_steps"] if sft_steps is None else sft_steps
    batch_size = defaults["sft_batch_size"] if batch_size is None else batch_size
    args = dict(task=task, options=options, seed=seed, hidden=hidden, layers=layers, sft_steps=sft_steps, size=size,
                eval_size=eval_size, batch_size=batch_size, lr=lr, task_seed=task_seed)
    if env != "none":
        args["env"] = env  # (absent otherwise: the folders of earlier studies keep their names)
    key = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(out_dir) / f"warm-{key}"
    if (folder / "config.json").is_file() and (folder / "warm_start.json").is_file():
        return folder
    if hidden % 32:
        raise ValueError(f"hidden: expected a multiple of the head size 32, got {hidden}")
    tok = char_tokenizer()
    task_ = make_task(task, **options, size=size, eval_size=eval_size, seed=task_seed)
    heads = hidden // 32
    model = tiny_random_model(tok, hidden_size=hidden, num_layers=layers, num_heads=heads,
                              num_kv_heads=max(1, heads // 2), seed=seed)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if env == "none":
            losses = sft_warm_start(model, tok, list(task_.train), steps=sft_steps, batch_size=batch_size, lr=lr, seed=seed)
        else:
            losses = agent_sft(model, tok, make_environment(env), list(task_.train), steps=sft_steps,
                               batch_size=batch_size, lr=lr, seed=seed)
    save_model(model, tok, folder)
    (folder / "warm_start.json").write_text(json.dumps(
        {**args, "final_loss": losses[-1], "seconds": time.perf_counter() - t0}, indent=1))
    return folder


def sanity_config(study: SanityConfig, model_dir: str | Path, run_dir: str | Path, method: str, seed: int) -> Config:
    """The trainer config of one (method, seed) of `study`: HF engine in `engine_dtype` (bf16 by default), fp32
    trainer, the study's task and split (the warm start's), its lr, batch, `mini_batches` optimiser steps per
    rollout batch and response budget (resolved per task), evaluation only after training, no TensorBoard.
    `method` is a spec of `method_loss`."""
    s = study.resolve()
    return replace(
        Config(),
        model={"name": str(model_dir), "dtype": "float32", "precision": "fp32"},  # on every CPU: the lag is the mismatch
        rollout={"engine": "hf", "dtype": s.engine_dtype, "quantization": s.quantization, "engine_lag": s.engine_lag,
                 "episodes": "single" if s.env == "none" else "env",
                 "prompts_per_step": s.prompts_per_step, "group_size": s.group_size,
                 "max_new_tokens": s.max_new_tokens},  # top-K: recorded where the region needs it
        task={"name": s.task, "options": json.dumps(s.options), "size": s.size, "eval_size": s.eval_size,
              "seed": TASK_SEED},
        loss={**method_loss(method), "split_mismatch": s.split_mismatch},
        **({"env": {"name": s.env, "max_turns": s.max_turns, "max_tokens": EPISODE_TOKENS_PER_TURN * s.max_turns}}
           if s.env != "none" else {}),
        optim={"lr": s.lr},
        train={"steps": s.steps, "mini_batches": s.mini_batches, "micro_batch_size": MICRO_BATCH_SIZE, "seed": seed,
               "eval_before": False, "eval_every": 0, "threads": s.threads},
        log={"run_dir": str(run_dir), "report_to": ("none",), "progress": False, "samples_per_step": 0},
    )


def study_settings(study: SanityConfig, model_dir: Path) -> dict[str, Any]:
    """What `sanity.json` records as the study's settings: the resolved config, its task options, the engine, the
    trainer dtype and the warm-start folder (`dppo.studies.sanity.report` compares these between studies)."""
    return {**dataclasses.asdict(study.resolve()), "task_options": study.options, "engine": "hf",
            "trainer_dtype": "float32", "warm_start": str(model_dir)}


def _run_seed(study: SanityConfig, model_dir: Path, method: str, seed: int) -> tuple[dict[str, Any], list[dict]]:
    """Train one (method, seed); its summary (`summarize_run`, plus seed, seconds, run folder and the evaluation
    after training) and its metric rows. A run the trainer stops (too many non-finite steps) counts as collapsed."""
    run_dir = Path(study.out_dir) / f"{run_name(method)}-seed{seed}"
    cfg = sanity_config(study, model_dir, run_dir, method, seed)
    t0 = time.perf_counter()
    trainer = (NoisyRolloutTrainer(cfg, run_dir, logit_noise=study.logit_noise, noise_seed=10_007 * seed + 1)
               if study.logit_noise > 0 else Trainer(cfg, run_dir))
    cfg.save(run_dir / "config.yaml")  # (as `dppo train` writes it: `dppo doctor` reads it)
    error = None
    try:
        results = trainer.train()
    except RuntimeError as exc:  # e.g. too many non-finite steps in a row: that is a collapse, record it
        results, error = {}, str(exc)
    finally:
        trainer.close()
    seconds = time.perf_counter() - t0
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    summary = summarize_run(rows)
    if error:
        summary.update(collapsed=True, collapse_reason=f"run stopped: {error}")
    summary.update(seed=seed, seconds=seconds, run_dir=str(run_dir),
                   **{"eval_pass@1": (results.get("eval_after") or {}).get("pass@1")})
    return summary, rows


def _run_method(study: SanityConfig, model_dir: Path, method: str, verbose: bool) -> dict[str, Any]:
    """Every seed of one method: its loss section, summary over seeds, per-seed summaries and curves."""
    per_seed, runs = [], []
    for seed in study.seeds:
        summary, rows = _run_seed(study, model_dir, method, seed)
        per_seed.append(summary)
        runs.append(rows)
        if verbose:
            print(f"[sanity] {method} seed {seed}: {summary['seconds']:.1f} s, accuracy "
                  f"{fmt(summary['initial_accuracy'])} -> {fmt(summary['final_accuracy'])}, max |π−µ| "
                  f"{fmt(summary['max_mismatch'], '.4f')}, collapsed "
                  f"{'yes (' + summary['collapse_reason'] + ')' if summary['collapsed'] else 'no'}", flush=True)
    return {
        "loss": {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in method_loss(method).items()},
        "summary": summarize_method(per_seed), "per_seed": per_seed,
        "curves": {key: curves(runs, key) for key, _ in CURVE_KEYS},
    }


def run_sanity(study: SanityConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Run every (method, seed) of `study` from the same warm-started model; write sanity.json and sanity.png in
    its out_dir; return the report (settings, criteria, methods, wall_s, table).

    The warm start is one model (seed `warm_seed`) shared by all runs; the seeds vary the RL run (sampling, data
    order, mini-batch split, logit noise)."""
    study = study.resolve()
    if study.threads:
        torch.set_num_threads(study.threads)
    out_dir = Path(study.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    model_dir = warm_start(out_dir, seed=study.warm_seed, hidden=study.hidden, layers=study.layers,
                           sft_steps=study.sft_steps, size=study.size, eval_size=study.eval_size, task=study.task,
                           options=study.options, env=study.env)
    if verbose:
        warm_info = json.loads((model_dir / "warm_start.json").read_text())
        print(f"[sanity] warm start {model_dir} ({time.perf_counter() - t_all:.1f} s; SFT loss "
              f"{warm_info['final_loss']:.3f})", flush=True)
    report: dict[str, Any] = {"settings": study_settings(study, model_dir), "criteria": dict(CRITERIA),
                              "methods": {m: _run_method(study, model_dir, m, verbose) for m in study.methods}}
    report["wall_s"] = time.perf_counter() - t_all
    (out_dir / "sanity.json").write_text(json.dumps(report, indent=1))
    plot_sanity(report["methods"], out_dir / "sanity.png")
    report["table"] = format_table(report["methods"])
    if verbose:
        print(report["table"])
        print(f"[sanity] wall {report['wall_s']:.0f} s; wrote {out_dir / 'sanity.json'} and {out_dir / 'sanity.png'}",
              flush=True)
    return report


def cmd_sanity(argv: list[str]) -> int:
    """`dppo sanity [FLAGS]` (the flags are `SanityConfig`'s fields), `dppo sanity report ...` and `dppo sanity
    warning ...`. Exit 2 with one line naming the field for a value the config rejects; tyro's exit code for one it
    cannot read."""
    if argv[:1] == ["report"]:  # `dppo sanity report DIR ...`: tables from finished runs
        return cmd_report(argv[1:])
    if argv[:1] == ["warning"]:  # `dppo sanity warning PATH ...`: the collapse warning's held-out study
        return cmd_warning(argv[1:])
    try:
        try:
            study = parse_args(argv)
        except SystemExit as exc:  # tyro: --help (0) or a value it cannot read (2, its message printed)
            return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
        run_sanity(study)
    except ValueError as exc:
        print(f"dppo sanity: error: {exc}")
        return 2
    return 0
