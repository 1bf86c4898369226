"""The study's one config: `SanityConfig`, its fields the `dppo sanity` flags (read by tyro), checked once.

    dppo sanity [--methods all|key|relax|delta|fig5|stale|NAME[:field=value...],...] [--seeds 0,1,2] [--steps 60]
                [--task addition|reverse] [--min-len 16] [--max-len 20]
                [--lr 3e-4 (addition) | 1e-4 (reverse)] [--prompts-per-step 32] [--group-size 8] [--mini-batches 4]
                [--engine-dtype bfloat16|float32] [--logit-noise SIGMA] [--mismatch none|bf16|fp8|lag:K|noise:SIGMA]
                [--sft-steps N] [--env none|feedback] [--max-turns 3] [--split-mismatch]
                [--out-dir runs/sanity-<timestamp>] [--quick]

Each field's docstring is its `--help` text; `--methods` and `--seeds` take comma-separated lists. `__post_init__`
checks every field, so an invalid value fails before the warm start, naming the field
(`steps: expected >= 1, got 0`). A few values are derived (`SanityConfig.resolve`): `--mismatch` and `--quick`
set the fields they stand for, groups in `--methods` become their methods, and lr, SFT steps and the response
budget default per task (`TASK_DEFAULTS`, `default_max_new_tokens`). The resolved config is what `sanity.json`
records as the study's settings (`dataclasses.asdict`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

import tyro

from dppo.studies.sanity.methods import expand_methods, parse_mismatch
from dppo.train.config import ConfigError

SANITY_TASKS = ("addition", "reverse")
"""The built-in tasks the study can run on (`--task`)."""
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
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
QUICK: dict[str, Any] = {"methods": ("dppo-binary-tv", "pg-is"), "seeds": (0,), "steps": 5, "prompts_per_step": 8,
                         "group_size": 4, "hidden": 64}
"""What `--quick` sets (and the SFT steps to the task's `quick_sft_steps`), whatever the other flags say."""


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


def _comma_list(kind: Callable[[str], Any], metavar: str) -> tyro.constructors.PrimitiveConstructorSpec:
    """How tyro reads a tuple field from one comma-separated argument (`--seeds 0,1,2`)."""
    def parse(args: list[str]) -> tuple:
        try:
            return tuple(kind(s.strip()) for s in args[0].split(",") if s.strip())
        except ValueError:
            raise ValueError(f"expected a comma-separated list of {metavar}, got {args[0]!r}") from None

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar=f"{metavar},...", instance_from_str=parse, is_instance=lambda x: isinstance(x, tuple),
        str_from_instance=lambda x: [",".join(map(str, x))])


MethodList = Annotated[tuple[str, ...], _comma_list(str, "SPEC")]
SeedList = Annotated[tuple[int, ...], _comma_list(int, "INT")]


def _fail(name: str, message: str) -> None:
    raise ConfigError(f"{name}: {message}")


@dataclass(frozen=True)
class SanityConfig:
    """`dppo sanity`: the paper's stability study (Fig. 3, §5) and its ablations (§6, §7.3, F.4) scaled to a CPU."""

    methods: MethodList = ("all",)
    """Method specs NAME[:field=value...] (e.g. dppo-binary-tv:delta=0.1) or groups: all (Fig. 3's 9 methods),
    key (the 6 of the mismatch study), relax (the relax-alpha ablation), delta (the delta sweep of F.4), fig5
    (PG-IS with the negative-sample mask), stale (the trust regions for stale data beside 5 baselines)."""
    seeds: SeedList = (0, 1, 2)
    """RL seeds (sampling, data order, mini-batch split, logit noise); every run starts from the same warm start."""
    steps: int = 60
    """Training steps (rollout batches) per run."""
    lr: float | None = None
    """AdamW lr, the same for every method (default per task: addition 3e-4, reverse 1e-4)."""
    prompts_per_step: int = 32
    """P prompts per rollout batch."""
    group_size: int = 8
    """G responses per prompt."""
    mini_batches: int = 4
    """Optimiser steps per rollout batch (the later mini-batches are off-policy)."""
    max_new_tokens: int | None = None
    """Response budget (default per task: addition 4, reverse max-len + 2)."""
    task: Literal["addition", "reverse"] = "addition"
    """addition (answers <= 3 tokens) or reverse (reverse a --min-len..--max-len digit string)."""
    digits: int = 1
    """addition: operand digits (1: 100 questions)."""
    min_len: int = 16
    """reverse: shortest string (answer length in tokens)."""
    max_len: int = 20
    """reverse: longest string (max_new_tokens = max-len + 2)."""
    size: int = 80
    """Training prompts of the task (also the warm start's SFT data)."""
    eval_size: int = 20
    """Held-out prompts, evaluated once after training."""
    hidden: int = 128
    """Warm-start model hidden size (head size 32)."""
    layers: int = 2
    """Warm-start model layers."""
    sft_steps: int | None = None
    """Supervised warm-start steps (default per task: addition 60 of batch 64, reverse 215 of batch 32)."""
    warm_seed: int = 0
    """Seed of the warm start, the one model every run starts from."""
    env: Literal["none", "feedback"] = "none"
    """Multi-turn episodes: none (one response per prompt), or feedback (a wrong answer is told to try again, up to
    --max-turns turns, reward 0.5^attempt; the warm start learns the episode layout from the environment's
    demonstrations, `dppo.train.sft`). Accuracy is then the share of episodes right at the first attempt."""
    max_turns: int = 3
    """--env feedback: turns per episode (each at most --max-new-tokens tokens)."""
    engine_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Rollout engine dtype (the trainer is fp32; float32 with --logit-noise 0 = no mismatch)."""
    logit_noise: float = 0.0
    """sigma of N(0, sigma^2) noise on every logit the engine samples from (recorded as mu)."""
    quantization: Literal["none", "fp8"] = "none"
    """Engine weights: none, or fp8 (rollout.quantization)."""
    engine_lag: int = 0
    """The engine samples with the weights of this many optimiser steps ago (rollout.engine_lag)."""
    mismatch: str | None = None
    """The rollout-side mismatch, overriding --engine-dtype, --logit-noise, --quantization and --engine-lag: none
    (float32 engine), bf16, fp8 (fp8 weights), lag:K (engine K optimiser steps behind), noise:SIGMA."""
    split_mismatch: bool = False
    """Log the mismatch split and the ledger's drift terms (loss.split_mismatch: one extra forward per step)."""
    threads: int = 1
    """torch threads (0: torch's default)."""
    out_dir: str | None = None
    """Output folder (default: runs/sanity-<timestamp>)."""
    quick: bool = False
    """A short check, overriding those flags: dppo-binary-tv and pg-is, seed 0, 5 steps, 8 prompts x 4, a small
    warm start."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "mini_batches", "digits", "size", "hidden", "layers",
                     "max_new_tokens", "sft_steps", "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                _fail(name, f"expected >= 1, got {value}")
        for name in ("eval_size", "warm_seed", "engine_lag", "threads"):
            if getattr(self, name) < 0:
                _fail(name, f"expected >= 0, got {getattr(self, name)}")
        if self.lr is not None and not 0 < self.lr < math.inf:
            _fail("lr", f"expected a finite value > 0, got {self.lr!r}")
        if not self.seeds or len(set(self.seeds)) < len(self.seeds):
            _fail("seeds", f"expected one or more distinct seeds, got {self.seeds!r}")
        if not self.methods:
            _fail("methods", "expected one or more methods")
        try:
            expand_methods(self.methods)
        except ValueError as exc:
            _fail("methods", str(exc).removeprefix("method: "))
        task_options(self.task)  # checks the name
        if self.env not in ("none", "feedback"):
            _fail("env", f"expected 'none' or 'feedback', got {self.env!r}")
        if self.engine_dtype not in ("bfloat16", "float32"):
            _fail("engine_dtype", f"expected 'bfloat16' or 'float32', got {self.engine_dtype!r}")
        if self.quantization not in ("none", "fp8"):
            _fail("quantization", f"expected 'none' or 'fp8', got {self.quantization!r}")
        if not self.logit_noise >= 0 or not math.isfinite(self.logit_noise):
            _fail("logit_noise", f"expected a finite value >= 0, got {self.logit_noise!r}")
        if self.mismatch is not None:
            parse_mismatch(self.mismatch)  # ValueError naming --mismatch

    @property
    def options(self) -> dict[str, int]:
        """The task's `make_task` options (`task_options`)."""
        return task_options(self.task, digits=self.digits, min_len=self.min_len, max_len=self.max_len)

    def resolve(self) -> SanityConfig:
        """This config with every derived value set: `mismatch` and `quick` applied, groups in `methods` expanded,
        lr, sft_steps and max_new_tokens from the task's defaults when None, out_dir runs/sanity-<timestamp> when
        None. Idempotent; `mismatch` and `quick` stay, as a record of what was asked for."""
        cfg = self
        if cfg.mismatch is not None:
            cfg = dataclasses.replace(cfg, **parse_mismatch(cfg.mismatch))
        defaults = TASK_DEFAULTS[cfg.task]
        if cfg.quick:
            cfg = dataclasses.replace(cfg, **QUICK, sft_steps=defaults["quick_sft_steps"])
        return dataclasses.replace(
            cfg, methods=tuple(expand_methods(cfg.methods)),
            lr=defaults["lr"] if cfg.lr is None else cfg.lr,
            sft_steps=defaults["sft_steps"] if cfg.sft_steps is None else cfg.sft_steps,
            max_new_tokens=(default_max_new_tokens(cfg.task, cfg.options) if cfg.max_new_tokens is None
                            else cfg.max_new_tokens),
            out_dir=cfg.out_dir or f"runs/sanity-{_dt.datetime.now():%Y%m%d-%H%M%S}")


class _Unchecked(SanityConfig):
    """SanityConfig as tyro builds it from the flags: the checks run after, so a rejected value is one line."""

    def __post_init__(self) -> None:
        pass


def parse_args(argv: list[str]) -> SanityConfig:
    """The `SanityConfig` of a `dppo sanity` command line, read by tyro (flags = the fields, `--help` = their
    docstrings). A value tyro cannot read (`--steps x`) exits 2 with tyro's message; a value the config rejects
    raises ConfigError naming the field."""
    parsed = tyro.cli(_Unchecked, args=argv, prog="dppo sanity", description=SanityConfig.__doc__)
    return SanityConfig(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(SanityConfig)})
