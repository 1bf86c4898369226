"""The `dppo` command: train, eval, plot, presets.

    dppo train [--preset NAME] [--config FILE] [--run-dir DIR] [--resume DIR] [--section.field VALUE ...]
    torchrun --nproc_per_node N -m dppo.cli train --run-dir DIR ...   (multi-process: see dppo/train/distributed.py)
    dppo eval  [--run-dir DIR | --preset NAME | --config FILE] [--section.field VALUE ...]
    dppo plot  RUN_DIR [RUN_DIR ...] [--out FILE]
    dppo presets
    dppo sanity [--methods all|key|relax|delta|NAME[:field=value],...] [--seeds ...] [--steps N] [--lr LR]
                [--engine-dtype bfloat16|float32] [--logit-noise SIGMA] [--quick]
    dppo diagnose [--model NAME] [--engine auto|hf|vllm] [--engine-dtype bfloat16] [--n-prompts N] ...

Config fields are tyro flags over the dataclass tree of `dppo.train.config` (`dppo train --help` lists them all with
their docstrings). Precedence: defaults < preset < --config file < flags. Every value is validated before any
model is loaded.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from dppo.train.config import Config, ConfigError, replace
from dppo.train.distributed import DistributedError
from dppo.train.presets import PRESETS, get_preset

_TOP = """Top-level options (before or among the field flags):
  --preset NAME     start from a preset (`dppo presets` lists them; default: demo)
  --config FILE     start from a saved YAML/JSON config (e.g. a run's config.yaml)
  --run-dir DIR     where the run writes (default: runs/<timestamp>-<preset>)
  --resume DIR      continue the run in DIR from its newest complete checkpoint"""


def _split_args(argv: list[str], *, resume: bool) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--preset", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--run-dir", "--log.run-dir", dest="run_dir", default=None)
    if resume:
        p.add_argument("--resume", default=None)
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


def parse_config(argv: list[str], *, prog: str, resume: bool = True) -> tuple[Config, argparse.Namespace, str]:
    """Resolve the config for `train`/`eval` from argv (raises ConfigError naming the field)."""
    import tyro

    ns, rest = _split_args(argv, resume=resume)
    base, label = _base_config(ns)
    if "-h" in rest or "--help" in rest:
        tyro.cli(Config, default=base, args=["--help"], prog=prog, description=__doc__ + "\n" + _TOP)
    try:
        cfg = tyro.cli(Config, default=base, args=rest, prog=prog, description=_TOP)
    except SystemExit as exc:
        if exc.code:
            raise ConfigError(f"command line: could not parse {' '.join(rest)} (see `{prog} --help`)") from None
        raise
    if ns.run_dir:
        cfg = replace(cfg, log={"run_dir": ns.run_dir})
    if getattr(ns, "resume", None):
        cfg = replace(cfg, log={"run_dir": ns.resume})
    return cfg, ns, label


def cmd_train(argv: list[str]) -> int:
    cfg, ns, label = parse_config(argv, prog="dppo train")
    resume = bool(getattr(ns, "resume", None))
    from dppo.train.distributed import world_from_env

    _, world, _ = world_from_env()
    if world > 1 and not cfg.log.run_dir:  # a timestamped default could differ between ranks
        raise ConfigError(f"--run-dir: required under torchrun (WORLD_SIZE={world}): every rank must name the same run directory")
    run_dir = Path(cfg.log.run_dir or Path("runs") / f"{_dt.datetime.now():%Y%m%d-%H%M%S}-{label}")
    cfg = replace(cfg, log={"run_dir": str(run_dir)})
    if not resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"--run-dir: {run_dir} already holds a run; use --resume {run_dir} or another directory")
    from dppo.train.trainer import Trainer
    from dppo.train.plot import plot_runs

    trainer = Trainer(cfg, run_dir, resume=resume)
    main_rank = trainer.dist.is_main  # under torchrun only rank 0 writes the run directory and prints
    if main_rank:
        cfg.save(run_dir / "config.yaml")
    try:
        results = trainer.train()
    finally:
        trainer.close()
    if not main_rank:
        return 0
    plot = plot_runs([run_dir], run_dir / "curves.png")
    summary = {"run_dir": str(run_dir), "plot": str(plot), **results}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[dppo] run directory: {run_dir}")
    print(f"[dppo] plot:          {plot}")
    for key in ("eval_before", "eval_after"):
        if key in results:
            r = results[key]
            print(f"[dppo] {key.replace('_', ' ')}: pass@1 {r['pass@1']:.3f} (mean reward {r['reward_mean']:.3f}, n={r['n']})")
    print(f"[dppo] checkpoint:    {results['checkpoint']}")
    if results.get("stopped_early"):
        print(f"[dppo] stopped by signal at step {results['step']}; resume with: dppo train --resume {run_dir}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    """Evaluate a run's newest checkpoint (--run-dir) or the configured base model on the task's held-out split."""
    ns0, _ = _split_args(argv, resume=False)
    from_run = ns0.run_dir and (Path(ns0.run_dir) / "config.yaml").is_file()
    if from_run:
        cfg, _, _ = parse_config(["--config", str(Path(ns0.run_dir) / "config.yaml"), *_drop_run_dir(argv)], prog="dppo eval", resume=False)
    else:
        cfg, _, _ = parse_config(argv, prog="dppo eval", resume=False)
    from dppo.train.evaluation import evaluate_checkpoint

    result = evaluate_checkpoint(cfg, Path(ns0.run_dir) if from_run else None)
    print(json.dumps(result))
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


def cmd_plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dppo plot", description="PNG curves of one or more runs, overlaid.")
    p.add_argument("run_dirs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default=None, help="output PNG (default: <first run>/curves.png, or compare.png for several)")
    args = p.parse_args(argv)
    from dppo.train.plot import plot_runs

    out = args.out or (Path(args.run_dirs[0]) / ("curves.png" if len(args.run_dirs) == 1 else "compare.png"))
    print(plot_runs(args.run_dirs, out))
    return 0


def cmd_presets(argv: list[str]) -> int:
    width = max(map(len, PRESETS))
    for name, (_, summary) in PRESETS.items():
        print(f"{name:<{width}}  {summary}")
    return 0


def cmd_diagnose(argv: list[str]) -> int:
    from dppo.studies.diagnose.cli import cmd_diagnose as run

    return run(argv)


def cmd_sanity(argv: list[str]) -> int:
    from dppo.studies.sanity import cmd_sanity as run

    return run(argv)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "plot": cmd_plot, "presets": cmd_presets, "diagnose": cmd_diagnose,
            "sanity": cmd_sanity}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"dppo: unknown command {cmd!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except (ConfigError, ValueError, DistributedError) as exc:
        print(f"dppo {cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
