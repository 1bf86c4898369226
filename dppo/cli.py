"""The `dppo` command: train, eval, export, plot, presets, sft.

    dppo --version
    dppo train [--preset NAME] [--config FILE] [--run-dir DIR] [--resume DIR] [--no-hf] [--section.field VALUE ...]
    torchrun --nproc_per_node N -m dppo.cli train --run-dir DIR ...   (multi-process: see dppo/train/distributed.py)
    dppo eval  [--run-dir DIR | --preset NAME | --config FILE] [--samples N] [--k 1,4,8] [--step N | --all-steps]
               [--section.field VALUE ...]
    dppo export RUN_DIR [--step N] OUT [--merged]
    dppo plot  RUN_DIR [RUN_DIR ...] [--out FILE]
    dppo doctor RUN_DIR [--no-picture]     (why is this run unstable? the trust-region ledger read in plain words)
    dppo presets
    dppo sft   [--preset NAME | --config FILE] --out DIR [--steps N] [--batch-size N] [--lr X] [--examples N]
               [--overwrite] [--section.field VALUE ...]
    dppo sanity [--methods all|key|relax|delta|NAME[:field=value],...] [--seeds ...] [--steps N] [--lr LR]
                [--engine-dtype bfloat16|float32] [--logit-noise SIGMA] [--quick]
    dppo diagnose [--model NAME] [--engine auto|hf|vllm] [--engine-dtype bfloat16] [--n-prompts N] ...

Config fields are tyro flags over the dataclass tree of `dppo.train.config` (`dppo train --help` lists them all with
their docstrings); the engines (rollout.engines) are spelled --rollout.engine/dtype/quantization/engine-lag,
--rollout.fleet and --rollout.<kind>.<field> (`dppo.train.engine_flags`). Precedence: defaults < preset < --config file < flags. Every value is validated before any
model is loaded.

Errors (docs/cli.md): a config, data or input error (the field, file and line it names), a run directory that cannot
be written (`RunDirError`: disk full, quota, I/O, read-only) and a checkpoint that cannot be used are one line on
stderr with no traceback (exit 2 for inputs, 1 for the run directory). For `dppo train` a ValueError counts as an
input error only while the run is being set up (config, data, model, checkpoint); once training runs, it and any
other exception keep their traceback. `--debug` (anywhere on the line) or DPPO_DEBUG=1 prints the traceback of
every error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import io
import json
import os
import re
import sys
import time
import traceback
import typing
from dataclasses import field
from pathlib import Path

import torch
import tyro

import dppo
from dppo.envs import make_environment
from dppo.run_files.checkpoint import CheckpointError, load_checkpoint, load_latest
from dppo.run_files.export import export_model
from dppo.runtime.noise import quiet_third_party
from dppo.run_files.run_dir import JsonlWriter, RunDirError, checkpoint_path, complete_checkpoints, guard, write_atomic
from dppo.studies.diagnose.cli import cmd_diagnose as diagnose_command
from dppo.studies.sanity import cmd_sanity as sanity_command
from dppo.train.build import build_model, build_task, check_environment
from dppo.train.config import Config, ConfigError, replace
from dppo.train.engine_flags import RolloutFlags, from_flags, given_flags, to_flags
from dppo.train.kinds import choose
from dppo.train.moved_fields import check_moved_flags, flag_value
from dppo.train.distributed import DistributedError, world_from_env
from dppo.train.evaluation import evaluate_checkpoints, failed_part, load_checkpoint_weights
from dppo.train.plot import plot_runs
from dppo.run_files.doctor import main as doctor
from dppo.train.presets import PRESETS, get_preset
from dppo.train.sft import agent_sft, save_model
from dppo.train.trainer import Trainer

_TOP = """Top-level options (before or among the field flags):
  --preset NAME     start from a preset (`dppo presets` lists them; default: demo)
  --config FILE     start from a saved YAML/JSON config (e.g. a run's config.yaml)
  --run-dir DIR     where the run writes (default: runs/<timestamp>-<preset>)
  --resume DIR      continue the run in DIR from its newest complete checkpoint
  --no-hf           do not write the final checkpoint's hf/ folder (a Hugging Face model; see `dppo export`)
  --debug           print the traceback of any error (also DPPO_DEBUG=1)"""


class InputError(ValueError):
    """A ValueError raised while a command reads its inputs (config, data, model, checkpoint): its message names
    the culprit, so it is printed as one line."""


@contextlib.contextmanager
def _inputs():
    """ValueErrors raised inside are input errors (InputError), printed as one line by `main`."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, (ConfigError, InputError)):
            raise
        raise InputError(str(exc)) from exc


def _split_args(argv: list[str], *, resume: bool) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--preset", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--run-dir", "--log.run-dir", dest="run_dir", default=None)
    if resume:
        p.add_argument("--resume", default=None)
        p.add_argument("--no-hf", dest="no_hf", action="store_true")
    return p.parse_known_args(argv)


def _base_config(ns: argparse.Namespace) -> tuple[Config, str]:
    if getattr(ns, "resume", None):
        path = Path(ns.resume) / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"--resume: {ns.resume} is not a run directory (no config.yaml)")
        return Config.load(path), "resume"
    if ns.config:
        if ns.preset:
            raise ConfigError("--preset: give either --preset or --config, not both")
        return Config.load(ns.config), Path(ns.config).stem
    name = ns.preset or "demo"
    return get_preset(name), name


_HINTS = typing.get_type_hints(Config)
CliConfig = dataclasses.make_dataclass(
    "Config", [(f.name, RolloutFlags if f.name == "rollout" else _HINTS[f.name], field(default_factory=f.default_factory))
               for f in dataclasses.fields(Config)],
    frozen=True, namespace={"__doc__": Config.__doc__, "__module__": __name__})
"""The run config as the command line parses it: `Config`'s sections, the rollout as
`dppo.train.engine_flags.RolloutFlags` (its engines as flags)."""


def cli_default(cfg: Config) -> CliConfig:
    """`cfg` as the parser's default (its engines as flags)."""
    return CliConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config) if f.name != "rollout"},
                     rollout=to_flags(cfg.rollout))


def from_cli(parsed: CliConfig, base: Config, args: list[str] = ()) -> Config:
    """The run config the parser's result spells from command line `args`, its engines read against `base`'s."""
    return Config(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(Config) if f.name != "rollout"},
                  rollout=from_flags(parsed.rollout, base.rollout.engines, given_flags(list(args))))


def parse_config(argv: list[str], *, prog: str, resume: bool = True) -> tuple[Config, argparse.Namespace, str]:
    """Resolve the config for `train`/`eval` from argv (raises ConfigError naming the field)."""
    ns, rest = _split_args(argv, resume=resume)
    base, label = _base_config(ns)
    base = choose(base, episodes=flag_value(rest, "--rollout.episodes"))
    if "-h" in rest or "--help" in rest:
        tyro.cli(CliConfig, default=cli_default(base), args=["--help"], prog=prog, description=__doc__ + "\n" + _TOP)
    check_moved_flags(rest)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = tyro.cli(CliConfig, default=cli_default(base), args=rest, prog=prog, description=_TOP)
    except SystemExit as exc:
        if exc.code:
            reason = parser_reason(said.getvalue())
            raise ConfigError(f"command line: could not parse {' '.join(rest)}{': ' + reason if reason else ''} "
                              f"(see `{prog} --help`)") from None
        raise
    finally:
        sys.stderr.write(said.getvalue())  # what tyro printed (its box), as it printed it
    try:
        cfg = from_cli(parsed, base, rest)  # (the engine flags read into rollout.engines, `dppo.train.engine_flags`)
    except ConfigError as exc:  # (as the parser says a field's refusal: the line, then the reason)
        raise ConfigError(f"command line: could not parse {' '.join(rest)}: {exc} (see `{prog} --help`)") from None
    if ns.run_dir:
        cfg = replace(cfg, log={"run_dir": ns.run_dir})
    if getattr(ns, "resume", None):
        cfg = replace(cfg, log={"run_dir": ns.resume})
    return cfg, ns, label


def parser_reason(box: str) -> str:
    """The reason inside the box tyro printed for a command line it refused, on one line (the error line repeats it:
    a user reading the last line sees why): a field's check ("agent.name: ...") or the unrecognised options and the
    flag tyro suggests ('' when the text has no box)."""
    rows = [line.strip().strip("│|").strip() for line in box.splitlines() if line.strip()[:1] not in ("╭", "╰")]
    parts: list[list[str]] = [[]]
    for row in rows:  # (a box of "│ … │" and "─" rules, or rules of "-" alone where the stream is not a terminal)
        if row and set(row) <= {"─", "-"}:
            parts.append([])
        elif row:
            parts[-1].append(row)
    texts = [" ".join(p) for p in parts]
    at = next((i for i, t in enumerate(texts) if ":" in t), None)  # (a title alone, "Value error", has none)
    if at is None:
        return ""
    reason = re.sub(r"^Error parsing \w+: ", "", texts[at])
    after = parts[at + 1] if at + 1 < len(parts) else []
    suggestions = [r.split()[0] for r in after if r.startswith("--")]
    if suggestions and "Perhaps you meant" in " ".join(after):
        reason += f"; perhaps you meant {', '.join(suggestions[:3])}"
    return reason


def cmd_train(argv: list[str]) -> int:
    with _inputs():
        cfg, ns, label = parse_config(argv, prog="dppo train")
    resume = bool(getattr(ns, "resume", None))

    _, world, _ = world_from_env()
    if world > 1 and not cfg.log.run_dir:  # a timestamped default could differ between ranks
        raise ConfigError(f"--run-dir: required under torchrun (WORLD_SIZE={world}): every rank must name the same run directory")
    run_dir = Path(cfg.log.run_dir or Path("runs") / f"{_dt.datetime.now():%Y%m%d-%H%M%S}-{label}")
    cfg = replace(cfg, log={"run_dir": str(run_dir)})
    if not resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"--run-dir: {run_dir} already holds a run; use --resume {run_dir} or another directory")

    with _inputs():
        trainer = Trainer(cfg, run_dir, resume=resume)
    main_rank = trainer.dist.is_main  # under torchrun only rank 0 writes the run directory and prints
    try:
        if main_rank:
            write_atomic(run_dir, run_dir / "config.yaml", trainer.cfg.save)  # resolved: δ, K, engine, dtype
        results = trainer.train()
    except BaseException:
        logger = getattr(trainer, "logger", None)
        if logger is not None:
            logger.close(quiet=True)  # trackers finished, files closed; the error that stopped the run is raised
        raise
    finally:
        trainer.close()  # the engine or the rollout workers, the process group
    if not main_rank:
        return 0
    with guard(run_dir, run_dir / "curves.png"):
        plot = plot_runs([run_dir], run_dir / "curves.png")
    summary = {"run_dir": str(run_dir), "plot": str(plot), **results}
    write_atomic(run_dir, run_dir / "summary.json", json.dumps(summary, indent=2))
    print(f"[dppo] run directory: {run_dir}")
    print(f"[dppo] plot:          {plot}")
    for line in eval_summary(results):
        print(line)
    print(f"[dppo] checkpoint:    {results['checkpoint']}")
    if results.get("stopped_early"):
        print(f"[dppo] stopped by signal at step {results['step']}; resume with: dppo train --resume {run_dir}")
    elif not ns.no_hf:
        print(f"[dppo] model:         {_export_final(run_dir, Path(results['checkpoint']), results['step'])}")
    return 0


def _export_final(run_dir: Path, checkpoint: Path, step: int) -> Path:
    """The final checkpoint's hf/ folder (a Hugging Face model folder, `dppo.run_files.export`)."""
    out = checkpoint / "hf"
    return export_checkpoint(run_dir, out, step=step, advice=f"the run itself finished ({checkpoint} is complete); "
                             f"free space, then write its model with: dppo export {run_dir} --step {step} {out}")


def _eval_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`dppo eval`'s own flags (the rest are config flags): --samples, --k, --step, --all-steps, checked."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--k", default=None)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--all-steps", dest="all_steps", action="store_true")
    try:
        ns, rest = p.parse_known_args(argv)
    except SystemExit:
        raise ConfigError("--samples/--k/--step: expected --samples N, --k K[,K...], --step N (integers)") from None
    if ns.k is not None:
        try:
            ns.k = sorted({int(k) for k in ns.k.split(",") if k.strip()})
        except ValueError:
            raise ConfigError(f"--k: expected comma-separated integers such as 1,4,8, got {ns.k!r}") from None
        if not ns.k or ns.k[0] < 1:
            raise ConfigError(f"--k: expected integers >= 1, got {ns.k}")
    if ns.samples is not None and ns.samples < 1:
        raise ConfigError(f"--samples: expected >= 1, got {ns.samples}")
    if ns.k and ns.samples is not None and ns.k[-1] > ns.samples:
        raise ConfigError(f"--k: {ns.k[-1]} is more than --samples {ns.samples} (pass@k and maj@k need k <= samples)")
    if ns.k and ns.samples is None:
        ns.samples = ns.k[-1]
    if ns.step is not None and ns.all_steps:
        raise ConfigError("--step: give either --step N or --all-steps, not both")
    return ns, rest


def cmd_eval(argv: list[str]) -> int:
    """Evaluate a run's newest checkpoint, the one of --step, or every one (--all-steps), or the configured base
    model, on the task's held-out split: pass@1, pass@k and maj@k over --samples responses per prompt. Results from a
    run are appended to its eval.jsonl (marked "by": "dppo eval"); each is printed as one JSON line."""
    own, argv = _eval_args(argv)
    ns0, _ = _split_args(argv, resume=False)
    from_run = ns0.run_dir and (Path(ns0.run_dir) / "config.yaml").is_file()
    if (own.step is not None or own.all_steps) and not from_run:
        raise ConfigError("--step: evaluating a checkpoint needs --run-dir DIR (a run directory with config.yaml)")
    if from_run:
        cfg, _, _ = parse_config(["--config", str(Path(ns0.run_dir) / "config.yaml"), *_drop_run_dir(argv)], prog="dppo eval", resume=False)
    else:
        cfg, _, _ = parse_config(argv, prog="dppo eval", resume=False)
    run_dir = Path(ns0.run_dir) if from_run else None
    results = evaluate_checkpoints(cfg, run_dir, step=own.step, every=own.all_steps, samples=own.samples, ks=own.k)
    if run_dir is not None:
        log = JsonlWriter(run_dir, run_dir / "eval.jsonl")
        try:
            log.write_lines([{**r, "by": "dppo eval"} for r in results])
        finally:
            log.close()
    for r in results:
        print(json.dumps(r))
    return 0


def _drop_run_dir(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--run-dir", "--log.run-dir"):
            skip = True
            continue
        if a.startswith(("--run-dir=", "--log.run-dir=")):
            continue
        out.append(a)
    return out


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dppo export", description="Write a run's checkpoint as a Hugging Face model "
                                "folder (config, generation config, tokenizer with chat template, safetensors) that "
                                "from_pretrained, vllm serve and push_to_hub take as it is.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (with config.yaml and checkpoints/)")
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that loads)")
    p.add_argument("--merged", action="store_true", help="LoRA: the base model with the adapter merged in "
                   "(default: the PEFT adapter folder)")
    args = p.parse_args(argv)

    print(export_checkpoint(args.run_dir, args.out, step=args.step, merged=args.merged))
    return 0


def export_checkpoint(run_dir: str | Path, out: str | Path, *, step: int | None = None, merged: bool = False,
                      advice: str | None = None) -> Path:
    """Write checkpoint `step` (default: the newest that loads) of the run in `run_dir` as a Hugging Face folder
    `out` (which must not exist): the model rebuilt from the run's config.yaml as the trainer built it, the
    checkpoint's weights loaded, written by `dppo.run_files.export.export_model`. ValueError naming the flag at
    fault for a missing run, step or checkpoint; RunDirError ending with `advice` (default: run the export again)
    when the disk cannot take it."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"RUN_DIR: {run_dir} is not a run directory (no config.yaml)")
    if out.exists():
        raise ValueError(f"OUT: {out} already exists; give a new folder")
    if step is not None:
        path = checkpoint_path(run_dir, step)
        if path not in complete_checkpoints(run_dir):
            have = ", ".join(str(int(p.name.split("_")[1])) for p in complete_checkpoints(run_dir)) or "none"
            raise ValueError(f"--step: no complete checkpoint {path.name} under {run_dir / 'checkpoints'} "
                             f"(complete steps: {have})")
        ckpt = load_checkpoint(path)
    else:
        found = load_latest(run_dir)
        if found is None:
            raise ValueError(f"RUN_DIR: no complete checkpoint under {run_dir / 'checkpoints'}")
        path, ckpt = found
    cfg = replace(Config.load(run_dir / "config.yaml"), model={"device": "cpu", "gradient_checkpointing": False})
    model, tokenizer, base = build_model(cfg, run_dir)
    load_checkpoint_weights(model, ckpt["weights"], path, flag="RUN_DIR")
    return export_model(model, tokenizer, out, merged=merged, base=base, run_dir=run_dir, advice=advice)


def cmd_plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dppo plot", description="PNG curves of one or more runs, overlaid.")
    p.add_argument("run_dirs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default=None, help="output PNG (default: <first run>/curves.png, or compare.png for several)")
    args = p.parse_args(argv)

    out = args.out or (Path(args.run_dirs[0]) / ("curves.png" if len(args.run_dirs) == 1 else "compare.png"))
    print(plot_runs(args.run_dirs, out))
    return 0


def cmd_doctor(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dppo doctor", description="Why is this run unstable? Reads a run directory "
                                "(also a running one) and says which source drives the policy's drift from µ, "
                                "what the trust region masks, and what to change (dppo.run_files.doctor).")
    p.add_argument("run_dir", help="a run directory (with metrics.jsonl and config.yaml)")
    p.add_argument("--no-picture", action="store_true", help="do not write <run_dir>/doctor.png")
    args = p.parse_args(argv)
    try:
        doctor(args.run_dir, picture=not args.no_picture)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    return 0


def cmd_presets(argv: list[str]) -> int:
    width = max(map(len, PRESETS))
    for name, (_, summary) in PRESETS.items():
        print(f"{name:<{width}}  {summary}")
    return 0


def cmd_sft(argv: list[str]) -> int:
    """A supervised warm start on the environment's demonstrations (dppo.train.sft), saved as a model folder
    that `dppo train --model.name DIR` starts RL from."""
    p = argparse.ArgumentParser(prog="dppo sft", add_help=False, description="Supervised warm start on the config's "
                                "environment's demonstrations (the tool format), saved as a Hugging Face model folder. "
                                "The preset (or --config) gives the model, the task and env.* ; other field flags "
                                "(--model.name, --task.options, ...) override them as for `dppo train`.")
    p.add_argument("--out", default=None, help="the model folder to write (required)")
    p.add_argument("--steps", type=int, default=3, help="optimiser steps (default 3: SmolLM2's loss on the calculator's "
                   "transcripts falls 0.83 -> 0.11, leaving RL room; 8 steps at lr 5e-5 reach 5e-4)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8, help="transcripts per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (default 3e-5)")
    p.add_argument("--examples", type=int, default=0, help="train on the first N training examples (default: all)")
    p.add_argument("--log-every", dest="log_every", type=int, default=5, help="print the loss every N steps (0 = never)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help:
        p.print_help()
        print("\n" + _TOP.split("\n  --run-dir")[0])
        return 0
    if not args.out:
        raise ConfigError("--out: required (the model folder to write)")
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ConfigError(f"{flag}: expected >= 1, got {value}")
    if not args.lr > 0:
        raise ConfigError(f"--lr: expected > 0, got {args.lr}")
    if args.examples < 0:
        raise ConfigError(f"--examples: expected >= 0, got {args.examples}")
    cfg, ns, label = parse_config(rest, prog="dppo sft", resume=False)
    if not cfg.episode_settings.demonstrations or not cfg.env.name:
        raise ConfigError("rollout.episodes: dppo sft trains on an environment's demonstrations; give a preset with "
                          "an environment (calculator, python_tool, feedback) or --rollout.episodes env --env.name NAME")
    out = Path(args.out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"--out: {out} already exists (give another folder, or --overwrite to replace it)")

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    task = build_task(cfg)
    examples = list(task.train)[: args.examples or None]
    check_environment(cfg, examples)
    factory = make_environment(cfg.env.name, **cfg.env.options_dict)
    model, tokenizer, _ = build_model(cfg)
    print(f"[dppo] sft: {cfg.model.name} on {len(examples)} {cfg.env.name!r} demonstrations of {cfg.task.name}, "
          f"{args.steps} steps x {args.batch_size}, lr {args.lr:g}", flush=True)
    t0 = time.perf_counter()
    losses = agent_sft(model, tokenizer, factory, examples, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                       seed=cfg.train.seed, log_every=args.log_every)
    seconds = time.perf_counter() - t0
    if hasattr(model, "merge_and_unload"):  # LoRA: a plain model folder, the adapter merged in
        model = model.merge_and_unload()
    save_model(model, tokenizer, out, overwrite=args.overwrite)
    info = {"config": label, "model": cfg.model.name, "env": cfg.env.name, "task": cfg.task.name,
            "task_options": cfg.task.options_dict, "examples": len(examples), "steps": args.steps,
            "batch_size": args.batch_size, "lr": args.lr, "seconds": round(seconds, 1), "losses": losses}
    write_atomic(out, out / "sft.json", json.dumps(info, indent=2))
    start = f"--config {ns.config}" if ns.config else f"--preset {ns.preset or 'demo'}"
    print(f"[dppo] sft: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {seconds:.0f}s")
    print(f"[dppo] model:         {out}")
    print(f"[dppo] start RL from it: dppo train {start} --model.name {out}")
    return 0


def cmd_diagnose(argv: list[str]) -> int:
    return diagnose_command(argv)


def cmd_sanity(argv: list[str]) -> int:
    return sanity_command(argv)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "plot": cmd_plot, "presets": cmd_presets,
            "diagnose": cmd_diagnose, "sanity": cmd_sanity, "sft": cmd_sft, "doctor": cmd_doctor}
ONE_LINE = {ConfigError: 2, InputError: 2, DistributedError: 2, RunDirError: 1, CheckpointError: 1}
"""The errors `main` prints as one line (the message names the culprit), with their exit status."""


def eval_summary(results: dict) -> list[str]:
    """`dppo train`'s closing lines for the evaluations before and after training, with the failed and timed-out
    episodes that the step's eval line names."""
    return [f"[dppo] {key.replace('_', ' ')}: pass@1 {r['pass@1']:.3f} (mean reward {r['reward_mean']:.3f}, "
            f"n={r['n']}{failed_part(r)})" for key, r in ((k, results[k]) for k in ("eval_before", "eval_after")
                                                         if k in results)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("DPPO_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"dppo {dppo.__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    quiet_third_party()  # start-up warnings that say nothing about the run (dppo.runtime.noise)
    if cmd not in COMMANDS:
        print(f"dppo: unknown command {cmd!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        if cmd == "train":  # its own split: a ValueError is an input error only while the run is set up
            return COMMANDS[cmd](rest)
        with _inputs():  # eval, export, plot, sanity, diagnose: a ValueError names the input at fault
            return COMMANDS[cmd](rest)
    except tuple(ONE_LINE) as exc:
        if debug:
            traceback.print_exc()
        print(f"dppo {cmd}: error: {exc}", file=sys.stderr)
        code = next(code for cls, code in ONE_LINE.items() if isinstance(exc, cls))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the line is out, exit with its status now.
            sys.stdout.flush()  # A peer may still be inside a collective, and c10d's threads torn down at interpreter
            sys.stderr.flush()  # exit then abort the process ("terminate called ...", status -6), hiding the status.
            os._exit(code)
        return code


if __name__ == "__main__":
    sys.exit(main())
