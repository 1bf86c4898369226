"""`dppo sanity`: the paper's stability study (Fig. 3, §5) and its ablations (§6, §7.3, F.4) scaled to a CPU.

    dppo sanity [--methods all|key|relax|delta|NAME[:field=value...],...] [--seeds 0,1,2] [--steps 60]
                [--task addition|reverse] [--min-len 16] [--max-len 20]
                [--lr 3e-4 (addition) | 1e-4 (reverse)] [--prompts-per-step 32] [--group-size 8] [--mini-batches 4]
                [--engine-dtype bfloat16|float32] [--logit-noise SIGMA] [--out-dir runs/sanity-<timestamp>] [--quick]

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
differs, taken from the method presets of `dppo.train.presets`.

Methods: a preset name (`SANITY_METHODS`), optionally with loss-field overrides, e.g. `dppo-binary-tv:delta=0.1`
(`delta` sets δ_low and δ_high, `eps` sets ε_low and ε_high, any other `LossConfig` field by name), or a group
name from `METHOD_GROUPS` (all = the 9 methods of Fig. 3; key = the 6 of the mismatch study; relax = the
relax-α ablation of §6 beside its base; delta = the δ sweep of F.4).

The mismatch knob `--logit-noise σ` (`LogitNoise`): the engine samples every token from softmax(logits + σ·z),
z ~ N(0, 1) drawn afresh for every vocabulary entry at every sampled position, and records that perturbed
distribution's log-probs as µ (it is the distribution actually sampled from, so π/µ stays an exact importance
weight). It is a controlled stand-in for a noisy inference engine; the no-mismatch control is
`--engine-dtype float32 --logit-noise 0`. The noise is off during the evaluation after training.

Outputs in the out-dir: one run folder per (method, seed), `sanity.json` (settings, per-method summary, per-seed
summaries and curves), `sanity.png` (training reward and mismatch mean |π−µ| over steps, mean over seeds with a
min–max band) and a printed table; the time of every (method, seed) run is printed as it finishes.

Summary per run (see `summarize_run`):
- final accuracy: mean `reward/accuracy` of the last 5 steps;
- steps to 90%: first step whose `reward/accuracy` ≥ 0.9 ("-" if never);
- start / max / final mismatch: first-5-step mean, max and last-5-step mean of `mismatch/binary_tv_mean` (mean
  |π−µ| at the start of a step; final well above start = the mismatch drifted up);
- masked fraction: mean of `trust_region/masked_frac` over steps;
- **collapsed** (`is_collapsed`): yes when (a) the final accuracy is below half of the run's peak accuracy
  (peak of the 5-step running mean over full windows) and the peak is at least 0.05 above the final value, or (b) for 5
  consecutive steps every group had zero advantage while accuracy was below 0.5 (all-wrong groups: no
  gradient ever again). Per method, the table reports how many seeds collapsed.

`dppo sanity report DIR ... --control DIR ...` (`dppo.studies.sanity_report`) merges studies run as several
processes and prints a mismatch study beside its control, with the mismatch averaged per quarter of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from dppo.train.config import Config, ConfigError, LossConfig, replace
from dppo.train.plot import save_figure
from dppo.train.presets import PRESETS
from dppo.train.trainer import Trainer

SANITY_METHOD_NAMES = ("pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl",
                       "dppo-topk-tv", "dppo-topk-kl", "dppo-recompute")
"""The default method list (Fig. 3's methods)."""
RELAX_METHOD_NAMES = ("grpo-relax-high", "grpo-relax-low", "grpo-relax-both")
"""The relax-α ablation (§6): run on request (`--methods relax`)."""
FIG5_METHOD_NAMES = ("pg-is-neg-mask",)
"""Fig. 5 (§5.3): PG-IS with only the negative-sample mask (`--methods fig5`: δ 0.5 and 0.8, at µ and at π_old)."""
METHOD_GROUPS: dict[str, tuple[str, ...]] = {
    "all": SANITY_METHOD_NAMES,
    "key": ("pg-is", "cispo", "grpo-clip-higher", "minirl", "dppo-binary-tv", "dppo-binary-kl"),
    "relax": ("grpo-clip-higher",) + RELAX_METHOD_NAMES,
    "delta": ("dppo-binary-tv:delta=0.1", "dppo-binary-tv", "dppo-binary-tv:delta=0.2",
              "dppo-binary-kl", "dppo-binary-kl:delta=0.1", "dppo-binary-kl:delta=0.15"),
    "fig5": ("pg-is", "pg-is-neg-mask", "pg-is-neg-mask:neg_delta=0.8", "pg-is-neg-mask:anchor=recompute",
             "pg-is-neg-mask:neg_delta=0.8:anchor=recompute"),
}
"""Names usable in `--methods` for a list of methods."""
WINDOW = 5  # steps averaged for "final" values and the running peak
COLLAPSE_RATIO = 0.5
COLLAPSE_ZERO_ADV_STEPS = 5
TARGET_ACCURACY = 0.9


def _loss_overrides(preset: str) -> dict[str, Any]:
    """The loss section of a method preset: trust region, anchor and IS cap always, plus every field that
    differs from `LossConfig`'s defaults."""
    loss = PRESETS[preset][0]().loss
    default = LossConfig()
    out = {"trust_region": loss.trust_region, "anchor": loss.anchor, "is_cap": loss.is_cap}
    for f in dataclasses.fields(LossConfig):
        value = getattr(loss, f.name)
        if value != getattr(default, f.name):
            out[f.name] = value
    return out


SANITY_METHODS: dict[str, dict[str, Any]] = {name: _loss_overrides(name)
                                             for name in SANITY_METHOD_NAMES + RELAX_METHOD_NAMES + FIG5_METHOD_NAMES}
"""Method name -> `loss` section overrides (from `dppo.train.presets`). Top-K methods record µ's top-20 (the registry's
`needs_topk`, resolved by `Config.top_k_logprobs`)."""

_SHORTHANDS = {"delta": ("delta_low", "delta_high"), "eps": ("eps_low", "eps_high")}


def method_loss(method: str) -> dict[str, Any]:
    """The `loss` section of a method spec `NAME[:field=value...]`: the preset's overrides, then the given fields
    (`delta` = both δ, `eps` = both ε). ValueError naming the method for an unknown name, field or bad value."""
    name, *pairs = method.split(":")
    if name not in SANITY_METHODS:
        raise ValueError(f"method: unknown {name!r}; valid: {', '.join(SANITY_METHODS)} (or a group: "
                         f"{', '.join(METHOD_GROUPS)})")
    loss = dict(SANITY_METHODS[name])
    fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        targets = _SHORTHANDS.get(key, (key,))
        if not sep or any(t not in fields for t in targets):
            raise ValueError(f"method {method!r}: expected field=value with a loss field or delta/eps, got {pair!r}")
        try:
            value: Any = float(text)
        except ValueError:
            value = text
        for t in targets:
            loss[t] = value
    try:
        LossConfig(**loss)
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"method {method!r}: {exc}") from None
    return loss


MISMATCH_SOURCES = ("none", "bf16", "fp8", "lag:K", "noise:SIGMA")


def parse_mismatch(spec: str) -> dict[str, Any]:
    """The rollout-side mismatch of `--mismatch SPEC` as settings: none (float32 engine, the control), bf16 (a
    bf16 engine), fp8 (fp8 weights, `rollout.quantization`), lag:K (the engine K optimiser steps behind,
    `rollout.engine_lag`), noise:SIGMA (N(0, σ²) logit noise). ValueError naming `--mismatch` otherwise."""
    kind, _, arg = spec.partition(":")
    out = {"engine_dtype": "float32", "logit_noise": 0.0, "quantization": "none", "engine_lag": 0}
    try:
        if kind in ("none", "bf16", "fp8") and not arg:
            out.update({"bf16": {"engine_dtype": "bfloat16"}, "fp8": {"quantization": "fp8"}}.get(kind, {}))
            return out
        if kind == "lag" and int(arg) >= 1:
            return {**out, "engine_lag": int(arg)}
        if kind == "noise" and 0 < float(arg) < math.inf:
            return {**out, "logit_noise": float(arg)}
    except ValueError:
        pass
    raise ValueError(f"--mismatch: expected one of {', '.join(MISMATCH_SOURCES)} (K >= 1, SIGMA > 0), got {spec!r}")


def expand_methods(names: Sequence[str]) -> list[str]:
    """Group names replaced by their methods (order kept, duplicates dropped); each spec checked by `method_loss`."""
    out: list[str] = []
    for name in names:
        for m in METHOD_GROUPS.get(name, (name,)):
            method_loss(m)
            if m not in out:
                out.append(m)
    return out


def _run_name(method: str) -> str:
    return method.replace(":", "_").replace("=", "")


# ---------------------------------------------------------------------------------------------- the mismatch knob
class LogitNoise:
    """A controlled training–inference mismatch: Gaussian noise on the logits an engine samples from.

    Registers a forward hook on `engine_model`'s output embedding (the lm-head) that returns
    logits + σ·z in float32, z ~ N(0, 1) drawn from its own generator (seeded by `seed`) afresh for every row,
    position and vocabulary entry. An engine that samples from softmax(logits / τ) and records the log-probs of
    that distribution (the `hf` engine does) then samples from the perturbed policy µ_σ and records log µ_σ
    honestly. With σ = 0 or `enabled = False` the logits pass unchanged. (The `hf` engine runs a prompt's prefill
    once and shares its logits by the prompt's n responses, so at the first response position the noise is drawn
    once per distinct prompt; later positions get independent noise per response.)

    `record = True` keeps, for every hook call, the exact E_{a~µ_σ}|π(a) − µ_σ(a)| per row of the last position
    (π = the unperturbed distribution at temperature `temperature`) in `expected_tv` (list of [B] tensors): the
    mismatch the knob produces, which a Monte Carlo estimate over sampled tokens must match.
    """

    def __init__(self, engine_model: torch.nn.Module, sigma: float, *, seed: int = 0, temperature: float = 1.0,
                 record: bool = False) -> None:
        if not sigma >= 0 or not math.isfinite(sigma):
            raise ValueError(f"logit_noise: expected a finite value >= 0, got {sigma!r}")
        self.sigma, self.temperature, self.record = float(sigma), float(temperature), record
        self.enabled = True
        self.expected_tv: list[Tensor] = []
        self._gen = torch.Generator().manual_seed(int(seed))
        self._handle = engine_model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, inputs, output: Tensor) -> Tensor | None:
        if not self.enabled or self.sigma == 0.0:
            return None
        clean = output.float()
        noise = torch.randn(clean.shape, generator=self._gen, dtype=torch.float32).to(clean.device)
        noisy = clean + self.sigma * noise
        if self.record:
            p = (clean[:, -1] / self.temperature).softmax(-1)
            m = (noisy[:, -1] / self.temperature).softmax(-1)
            self.expected_tv.append((m * (p - m).abs()).sum(-1).cpu())
        return noisy

    def remove(self) -> None:
        self._handle.remove()


class _NoisyRolloutTrainer(Trainer):
    """A `Trainer` whose engine samples through `LogitNoise(σ)` during training; evaluation samples without it."""

    def __init__(self, cfg: Config, run_dir, *, logit_noise: float, noise_seed: int) -> None:
        super().__init__(cfg, run_dir)
        self.noise = LogitNoise(self.engine.model, logit_noise, seed=noise_seed, temperature=cfg.rollout.temperature)

    def evaluate(self, *args, **kwargs):
        self.noise.enabled = False
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.noise.enabled = True


# ---------------------------------------------------------------------------------------------- the task
SANITY_TASKS = ("addition", "reverse")
"""The built-in tasks the study can run on (`--task`)."""
TASK_DEFAULTS: dict[str, dict[str, int]] = {
    "addition": {"sft_steps": 60, "sft_batch_size": 64, "quick_sft_steps": 30, "lr": 3e-4},
    "reverse": {"sft_steps": 215, "sft_batch_size": 32, "quick_sft_steps": 100, "lr": 1e-4},
}
"""Per task, when not given: the warm start's SFT steps and batch size, the SFT steps of `--quick` (hidden 64) and
the RL lr (the same for every method).

reverse, measured on the default model (hidden 128, 2 layers, 80 training strings of 16-20 digits, one thread of
the 2-core EPYC Zen 4): sampled accuracy at temperature 1 on training prompts 0.035 after 205-210 SFT steps, 0.18
after 215, 0.35 after 230, 0.73 after 250 (the strings are memorised abruptly); 215 steps take ~20-25 s. From that
warm start, with no mismatch (`--mismatch none`, dppo-binary-tv): lr 3e-4 collapses within 3 steps (accuracy
0.19 -> 0.02), lr 1e-4 rises 0.20 -> 0.46 in 100 steps. `--quick`'s 100 SFT steps (~4 s) give responses of the
answer's length at accuracy 0."""


def task_options(task: str = "addition", *, digits: int = 1, min_len: int = 16, max_len: int = 20) -> dict[str, int]:
    """The `make_task` options of a study task: addition {digits}, reverse {min_len, max_len}. ValueError naming
    `task` for another name."""
    if task == "addition":
        return {"digits": digits}
    if task == "reverse":
        return {"min_len": min_len, "max_len": max_len}
    raise ValueError(f"task: expected one of {', '.join(SANITY_TASKS)}, got {task!r}")


def default_max_new_tokens(task: str, options: dict[str, Any]) -> int:
    """The study's response budget: 4 for addition (the study's default, as before: room for a 3-character sum and
    EOS), max_len + 2 for reverse (the answer, EOS and one token of slack, so an over-long answer shows as wrong)."""
    if task == "reverse":
        return int(options.get("max_len", 20)) + 2
    return 4


def _task_and_options(task: str, options: dict[str, Any] | None, digits: int) -> dict[str, Any]:
    if options is None:
        return task_options(task, digits=digits)
    task_options(task)  # checks the name
    return dict(options)


# ---------------------------------------------------------------------------------------------- the model
def warm_start(out_dir: str | Path, *, seed: int = 0, hidden: int = 128, layers: int = 2, sft_steps: int | None = None,
               digits: int = 1, size: int = 80, eval_size: int = 20, batch_size: int | None = None, lr: float = 3e-3,
               task_seed: int = 0, task: str = "addition", options: dict[str, Any] | None = None) -> Path:
    """A supervised warm start of a tiny char-level Qwen2 (head size 32) on `task` ("addition" with `digits`, or
    "reverse"; `options` replaces the task's options, default `task_options(task, digits=digits)`), saved to
    `out_dir/warm-<hash of the arguments, task and options included>/` and reused when that folder already holds a
    model. `sft_steps` / `batch_size` default to the task's `TASK_DEFAULTS`."""
    from dppo.runtime.models import char_tokenizer, save_model, tiny_random_model
    from dppo.studies.sft import sft_warm_start
    from dppo.tasks import make_task

    options = _task_and_options(task, options, digits)
    defaults = TASK_DEFAULTS[task]
    sft_steps = defaults["sft_steps"] if sft_steps is None else sft_steps
    batch_size = defaults["sft_batch_size"] if batch_size is None else batch_size
    args = dict(task=task, options=options, seed=seed, hidden=hidden, layers=layers, sft_steps=sft_steps, size=size,
                eval_size=eval_size, batch_size=batch_size, lr=lr, task_seed=task_seed)
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
        losses = sft_warm_start(model, tok, list(task_.train), steps=sft_steps, batch_size=batch_size, lr=lr, seed=seed)
    save_model(model, tok, folder)
    (folder / "warm_start.json").write_text(json.dumps(
        {**args, "final_loss": losses[-1], "seconds": time.perf_counter() - t0}, indent=1))
    return folder


def sanity_config(model_dir: str | Path, run_dir: str | Path, method: str, seed: int, *, steps: int = 60,
                  lr: float | None = None, prompts_per_step: int = 32, group_size: int = 8, mini_batches: int = 4,
                  digits: int = 1, size: int = 80, eval_size: int = 20, max_new_tokens: int | None = None,
                  micro_batch_size: int = 64, task_seed: int = 0, threads: int = 1,
                  engine_dtype: str = "bfloat16", quantization: str = "none", engine_lag: int = 0,
                  task: str = "addition", options: dict[str, Any] | None = None) -> Config:
    """The run config of one (method, seed): HF engine in `engine_dtype` (bf16 by default), fp32 trainer,
    `task` with `options` (default `task_options(task, digits=digits)`; the warm start's split), `max_new_tokens`
    (default `default_max_new_tokens`), `lr` (default the task's `TASK_DEFAULTS`), `mini_batches` optimiser steps
    per rollout batch, evaluation only after training, no TensorBoard. `method` is a spec of `method_loss`."""
    loss = method_loss(method)
    options = _task_and_options(task, options, digits)
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(task, options)
    lr = TASK_DEFAULTS[task]["lr"] if lr is None else lr
    return replace(
        Config(),
        model={"name": str(model_dir), "dtype": "float32"},
        rollout={"engine": "hf", "dtype": engine_dtype, "quantization": quantization, "engine_lag": engine_lag,
                 "prompts_per_step": prompts_per_step, "group_size": group_size,
                 "max_new_tokens": max_new_tokens},  # top-K: recorded where the region needs it
        task={"name": task, "options": json.dumps(options), "size": size, "eval_size": eval_size, "seed": task_seed},
        loss=loss,
        optim={"lr": lr},
        train={"steps": steps, "mini_batches": mini_batches, "micro_batch_size": micro_batch_size, "seed": seed,
               "eval_before": False, "eval_every": 0, "threads": threads},
        log={"run_dir": str(run_dir), "tensorboard": False, "progress": False, "samples_per_step": 0},
    )


# ---------------------------------------------------------------------------------------------- summaries
def _series(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def running_mean(xs: Sequence[float], window: int = WINDOW) -> list[float]:
    """Means over full windows of `window` consecutive values (one mean of everything when shorter)."""
    if len(xs) <= window:
        return [sum(xs) / len(xs)] if xs else []
    return [sum(xs[i - window: i]) / window for i in range(window, len(xs) + 1)]


def steps_to_accuracy(rows: Sequence[dict], target: float = TARGET_ACCURACY) -> int | None:
    """The first step (its `step` field, else 1-based index) whose `reward/accuracy` ≥ target; None if never."""
    for i, r in enumerate(rows, 1):
        if float(r.get("reward/accuracy", 0.0)) >= target:
            return int(r.get("step", i))
    return None


def is_collapsed(rows: Sequence[dict]) -> tuple[bool, str]:
    """(collapsed, reason). Collapsed when (a) the final accuracy (mean of the last 5 steps) is below half of the
    peak 5-step running mean (full windows), and the drop is at least 0.05; or (b) 5 consecutive steps had every group with
    zero advantage (`advantage/zero_group_frac` == 1) while accuracy was below 0.5."""
    acc = _series(rows, "reward/accuracy")
    if not acc:
        return False, "no steps"
    streak = 0
    for r in rows:
        dead = float(r.get("advantage/zero_group_frac", 0.0)) >= 1.0 - 1e-9 and float(r.get("reward/accuracy", 0.0)) < 0.5
        streak = streak + 1 if dead else 0
        if streak >= COLLAPSE_ZERO_ADV_STEPS:
            return True, f"every group zero-advantage for {COLLAPSE_ZERO_ADV_STEPS} steps (from step {int(r.get('step', 0)) - streak + 1})"
    peak = max(running_mean(acc))
    final = _mean(acc[-WINDOW:])
    if final < COLLAPSE_RATIO * peak and peak - final >= 0.05:
        return True, f"final accuracy {final:.3f} < {COLLAPSE_RATIO} x peak {peak:.3f}"
    return False, ""


def summarize_run(rows: Sequence[dict]) -> dict[str, Any]:
    """Final accuracy, steps to 90%, max/final mismatch, masked fraction and collapse of one run's metric rows."""
    acc = _series(rows, "reward/accuracy")
    tv = _series(rows, "mismatch/binary_tv_mean")
    collapsed, reason = is_collapsed(rows)
    return {
        "steps": len(rows),
        "initial_accuracy": _mean(acc[:WINDOW]),
        "final_accuracy": _mean(acc[-WINDOW:]),
        "peak_accuracy": max(running_mean(acc)) if acc else None,
        "steps_to_90": steps_to_accuracy(rows),
        "initial_mismatch": _mean(tv[:WINDOW]),
        "max_mismatch": max(tv) if tv else None,
        "final_mismatch": _mean(tv[-WINDOW:]),
        "masked_frac": _mean(_series(rows, "trust_region/masked_frac")),
        "collapsed": collapsed,
        "collapse_reason": reason,
    }


def summarize_method(per_seed: Sequence[dict]) -> dict[str, Any]:
    """Mean over seeds of the per-run summaries; steps to 90% is the median over seeds that reached it."""
    def avg(key):
        vals = [s[key] for s in per_seed if s.get(key) is not None]
        return _mean(vals)

    reached = sorted(s["steps_to_90"] for s in per_seed if s.get("steps_to_90") is not None)
    return {
        "seeds": len(per_seed),
        "initial_accuracy": avg("initial_accuracy"),
        "final_accuracy": avg("final_accuracy"),
        "final_accuracy_min": min((s["final_accuracy"] for s in per_seed if s["final_accuracy"] is not None), default=None),
        "final_accuracy_max": max((s["final_accuracy"] for s in per_seed if s["final_accuracy"] is not None), default=None),
        "steps_to_90": reached[len(reached) // 2] if reached else None,
        "reached_90": len(reached),
        "initial_mismatch": avg("initial_mismatch"),
        "max_mismatch": max((s["max_mismatch"] for s in per_seed if s["max_mismatch"] is not None), default=None),
        "final_mismatch": avg("final_mismatch"),
        "masked_frac": avg("masked_frac"),
        "collapsed": sum(bool(s["collapsed"]) for s in per_seed),
        "eval_pass@1": avg("eval_pass@1"),
        "seconds": avg("seconds"),
    }


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(methods: dict[str, dict]) -> str:
    """One row per method (means over seeds)."""
    width = max([18] + [len(n) + 2 for n in methods])
    head = (f"{'method':<{width}}{'seeds':>6}{'acc start':>10}{'acc final':>10}{'(min-max)':>13}{'steps→90%':>10}"
            f"{'start|π−µ|':>11}{'max|π−µ|':>10}{'final|π−µ|':>11}{'masked':>8}{'collapsed':>10}{'eval':>7}{'s/run':>7}")
    lines = [head]
    for name, m in methods.items():
        s = m["summary"]
        spread = f"{_fmt(s['final_accuracy_min'], '.2f')}-{_fmt(s['final_accuracy_max'], '.2f')}"
        to90 = "-" if s["steps_to_90"] is None else f"{s['steps_to_90']} ({s['reached_90']}/{s['seeds']})"
        lines.append(f"{name:<{width}}{s['seeds']:>6}{_fmt(s['initial_accuracy']):>10}{_fmt(s['final_accuracy']):>10}"
                     f"{spread:>13}{to90:>10}{_fmt(s.get('initial_mismatch'), '.4f'):>11}{_fmt(s['max_mismatch'], '.4f'):>10}{_fmt(s['final_mismatch'], '.4f'):>11}"
                     f"{_fmt(s['masked_frac']):>8}{str(s['collapsed']) + '/' + str(s['seeds']):>10}"
                     f"{_fmt(s['eval_pass@1'], '.2f'):>7}{_fmt(s['seconds'], '.0f'):>7}")
    return "\n".join(lines)


def _curves(runs: Sequence[Sequence[dict]], key: str) -> dict[str, list]:
    """Mean, min and max over seeds of `key` per step (steps present in every run)."""
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for i, r in enumerate(rows, 1):
            v = r.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_step.setdefault(int(r.get("step", i)), []).append(float(v))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
    return {"step": steps, "mean": [_mean(by_step[s]) for s in steps],
            "min": [min(by_step[s]) for s in steps], "max": [max(by_step[s]) for s in steps]}


CURVE_KEYS = (("reward/mean", "training reward"), ("mismatch/binary_tv_mean", "mismatch mean |π−µ| (start of step)"),
              ("trust_region/masked_frac", "masked fraction"))


def plot_sanity(methods: dict[str, dict], out: str | Path) -> Path:
    """Fig. 3 in miniature: one panel per curve in CURVE_KEYS, one line per method (mean over seeds, min–max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(6 * len(CURVE_KEYS), 4.5))
    for name, m in methods.items():
        for ax, (key, title) in zip(axes, CURVE_KEYS):
            c = m["curves"].get(key)
            if not c or not c["step"]:
                continue
            (line,) = ax.plot(c["step"], c["mean"], label=name, lw=1.5)
            ax.fill_between(c["step"], c["min"], c["max"], color=line.get_color(), alpha=0.15, lw=0)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, out)


# ---------------------------------------------------------------------------------------------- the study
def run_sanity(methods: Sequence[str], seeds: Sequence[int], out_dir: str | Path, *, steps: int = 60,
               lr: float | None = None,
               prompts_per_step: int = 32, group_size: int = 8, mini_batches: int = 4,
               max_new_tokens: int | None = None,
               digits: int = 1, size: int = 80, eval_size: int = 20, hidden: int = 128, layers: int = 2,
               sft_steps: int | None = None, warm_seed: int = 0, threads: int = 1, engine_dtype: str = "bfloat16",
               logit_noise: float = 0.0, quantization: str = "none", engine_lag: int = 0,
               task: str = "addition", min_len: int = 16, max_len: int = 20,
               verbose: bool = True) -> dict[str, Any]:
    """Run every (method, seed) from the same warm-started model; write sanity.json and sanity.png; return the report.

    The warm start is one model (seed `warm_seed`) shared by all runs; `seeds` vary the RL run (sampling, data
    order, mini-batch split, logit noise). `methods` are specs or group names (`expand_methods`);
    `engine_dtype` and `logit_noise` set the rollout-side mismatch (see the module docstring). `task` is addition
    (with `digits`) or reverse (with `min_len`..`max_len`); `lr`, `sft_steps` and `max_new_tokens` default per
    task (`TASK_DEFAULTS`, `default_max_new_tokens`)."""
    from dppo.train.plot import read_metrics

    options = task_options(task, digits=digits, min_len=min_len, max_len=max_len)
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(task, options)
    sft_steps = TASK_DEFAULTS[task]["sft_steps"] if sft_steps is None else sft_steps
    lr = TASK_DEFAULTS[task]["lr"] if lr is None else lr
    methods = expand_methods(methods)
    if not methods or not seeds:
        raise ValueError("methods and seeds must be non-empty")
    if engine_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"engine_dtype: expected 'bfloat16' or 'float32', got {engine_dtype!r}")
    if not logit_noise >= 0 or not math.isfinite(logit_noise):
        raise ValueError(f"logit_noise: expected a finite value >= 0, got {logit_noise!r}")
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    model_dir = warm_start(out_dir, seed=warm_seed, hidden=hidden, layers=layers, sft_steps=sft_steps, size=size,
                           eval_size=eval_size, task=task, options=options)
    warm_info = json.loads((model_dir / "warm_start.json").read_text())
    if verbose:
        print(f"[sanity] warm start {model_dir} ({time.perf_counter() - t0:.1f} s; SFT loss {warm_info['final_loss']:.3f})",
              flush=True)
    settings = dict(task=task, task_options=options, steps=steps, lr=lr, prompts_per_step=prompts_per_step,
                    group_size=group_size, mini_batches=mini_batches, max_new_tokens=max_new_tokens, digits=digits,
                    size=size, eval_size=eval_size, hidden=hidden, layers=layers, sft_steps=sft_steps, warm_seed=warm_seed,
                    seeds=list(seeds), engine="hf", engine_dtype=engine_dtype, logit_noise=logit_noise,
                    quantization=quantization, engine_lag=engine_lag,
                    trainer_dtype="float32", warm_start=str(model_dir))
    report: dict[str, Any] = {"settings": settings, "criteria": {
        "final_accuracy": f"mean reward/accuracy of the last {WINDOW} steps",
        "steps_to_90": f"first step with reward/accuracy >= {TARGET_ACCURACY} (median over the seeds that reached it)",
        "mismatch": "mismatch/binary_tv_mean: mean |π−µ| over response tokens at the start of a step",
        "collapsed": is_collapsed.__doc__.split("Collapsed when ")[1].strip()}, "methods": {}}
    for method in methods:
        per_seed, runs = [], []
        for seed in seeds:
            run_dir = out_dir / f"{_run_name(method)}-seed{seed}"
            cfg = sanity_config(model_dir, run_dir, method, seed, steps=steps, lr=lr, prompts_per_step=prompts_per_step,
                                group_size=group_size, mini_batches=mini_batches, size=size,
                                eval_size=eval_size, max_new_tokens=max_new_tokens, threads=threads,
                                engine_dtype=engine_dtype, quantization=quantization, engine_lag=engine_lag,
                                task=task, options=options)
            t0 = time.perf_counter()
            trainer = (_NoisyRolloutTrainer(cfg, run_dir, logit_noise=logit_noise, noise_seed=10_007 * seed + 1)
                       if logit_noise > 0 else Trainer(cfg, run_dir))
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
            per_seed.append(summary)
            runs.append(rows)
            if verbose:
                print(f"[sanity] {method} seed {seed}: {seconds:.1f} s, accuracy {_fmt(summary['initial_accuracy'])} -> "
                      f"{_fmt(summary['final_accuracy'])}, max |π−µ| {_fmt(summary['max_mismatch'], '.4f')}, "
                      f"collapsed {'yes (' + summary['collapse_reason'] + ')' if summary['collapsed'] else 'no'}",
                      flush=True)
        report["methods"][method] = {
            "loss": {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in method_loss(method).items()},
            "summary": summarize_method(per_seed), "per_seed": per_seed,
            "curves": {key: _curves(runs, key) for key, _ in CURVE_KEYS},
        }
    report["wall_s"] = time.perf_counter() - t_all
    (out_dir / "sanity.json").write_text(json.dumps(report, indent=1))
    plot_sanity(report["methods"], out_dir / "sanity.png")
    table = format_table(report["methods"])
    report["table"] = table
    if verbose:
        print(table)
        print(f"[sanity] wall {report['wall_s']:.0f} s; wrote {out_dir / 'sanity.json'} and {out_dir / 'sanity.png'}",
              flush=True)
    return report


# ---------------------------------------------------------------------------------------------- the command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dppo sanity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="all",
                   help="comma-separated method specs NAME[:field=value...] or groups (" +
                   "; ".join(f"{k} = {' '.join(v)}" for k, v in METHOD_GROUPS.items()) + ")")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    p.add_argument("--steps", type=int, default=60, help="training steps (rollout batches) per run")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW lr, the same for every method (default per task: addition 3e-4, reverse 1e-4)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="P prompts per rollout batch")
    p.add_argument("--group-size", type=int, default=8, help="G responses per prompt")
    p.add_argument("--mini-batches", type=int, default=4, help="optimiser steps per rollout batch")
    p.add_argument("--task", default="addition", choices=SANITY_TASKS,
                   help="addition (answers <= 3 tokens) or reverse (reverse a --min-len..--max-len digit string)")
    p.add_argument("--digits", type=int, default=1, help="addition operand digits (1: 100 questions)")
    p.add_argument("--min-len", type=int, default=16, help="reverse: shortest string (answer length in tokens)")
    p.add_argument("--max-len", type=int, default=20, help="reverse: longest string (max_new_tokens = max-len + 2)")
    p.add_argument("--hidden", type=int, default=128, help="warm-start model hidden size (head size 32)")
    p.add_argument("--layers", type=int, default=2, help="warm-start model layers")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="supervised warm-start steps (default per task: addition 60 of batch 64, "
                        "reverse 215 of batch 32)")
    p.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="rollout engine dtype (the trainer is fp32; float32 + --logit-noise 0 = no mismatch)")
    p.add_argument("--logit-noise", type=float, default=0.0,
                   help="sigma of N(0, sigma^2) noise on every logit the engine samples from (recorded as mu)")
    p.add_argument("--mismatch", default=None, metavar="SPEC",
                   help="the rollout-side mismatch, overriding --engine-dtype/--logit-noise: none (float32 engine), "
                        "bf16, fp8 (fp8 weights), lag:K (engine K optimiser steps behind), noise:SIGMA")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out-dir", default=None, help="output folder (default: runs/sanity-<timestamp>)")
    p.add_argument("--quick", action="store_true",
                   help="a short check: dppo-binary-tv and pg-is, seed 0, 5 steps, 8 prompts x 4, small warm start")
    return p


def cmd_sanity(argv: list[str]) -> int:
    if argv[:1] == ["report"]:  # `dppo sanity report DIR ...`: tables from finished runs
        from dppo.studies.sanity_report import cmd_report
        return cmd_report(argv[1:])
    args = _parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"dppo sanity: error: --seeds: expected comma-separated integers, got {args.seeds!r}")
        return 2
    kwargs = dict(steps=args.steps, lr=args.lr, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                  mini_batches=args.mini_batches, digits=args.digits, hidden=args.hidden, layers=args.layers,
                  sft_steps=args.sft_steps, threads=args.threads, engine_dtype=args.engine_dtype,
                  logit_noise=args.logit_noise, task=args.task, min_len=args.min_len, max_len=args.max_len)
    if args.mismatch is not None:
        try:
            kwargs.update(parse_mismatch(args.mismatch))
        except ValueError as exc:
            print(f"dppo sanity: error: {exc}")
            return 2
    if args.quick:
        methods, seeds = ["dppo-binary-tv", "pg-is"], [0]
        kwargs.update(steps=5, prompts_per_step=8, group_size=4, hidden=64,
                      sft_steps=TASK_DEFAULTS[args.task]["quick_sft_steps"])
    out_dir = Path(args.out_dir or Path("runs") / f"sanity-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    try:
        run_sanity(methods, seeds, out_dir, **kwargs)
    except ValueError as exc:
        print(f"dppo sanity: error: {exc}")
        return 2
    return 0
