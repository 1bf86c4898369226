"""Run logging: metrics.jsonl (one JSON line per step), samples.jsonl, eval.jsonl, a rich bar, and the experiment
trackers of `log.report_to` (TensorBoard, wandb, trackio), each given the config at start and every metric.

Only the logger touches files and the terminal; the trainer hands it plain Python numbers once per step.
In a multi-process run only rank 0's logger is active; the others' (`active=False`) write and print nothing.

Trackers are optional imports: `LogConfig` checks with `check_tracker_installed` that each listed tracker's
package is there before any model loads, and the tracker is imported only when the logger opens it. Each gets
the finite numbers of a step (NaN/inf stay in metrics.jsonl only). With `trackers_offline` (the default) nothing
leaves the machine: wandb runs with mode="offline" (and WANDB_ERROR_REPORTING=false, read when its service
starts), trackio is opened with TRACKIO_SPACE_ID / TRACKIO_SERVER_URL removed from the environment for the call,
so it writes only its local SQLite database. A resumed run opens a new tracker run under the same name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

TRACKERS = ("tensorboard", "wandb", "trackio")
"""The experiment trackers `log.report_to` can name (TRL's `report_to` names)."""

_INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard (a dppo dependency)"),
    "wandb": ("wandb", "pip install 'dppo[wandb]' (wandb==0.31.0)"),
    "trackio": ("trackio", "pip install 'dppo[trackio]' (trackio==0.43.0)"),
}


def check_tracker_installed(name: str) -> str | None:
    """None when tracker `name`'s package can be imported, else a message saying what to install (the package
    is looked up, not imported)."""
    module, how = _INSTALL[name]
    if importlib.util.find_spec(module) is None:
        return f"{name!r} needs the {module} package, which is not installed: {how}, or drop it from log.report_to"
    return None


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _plain(value: Any) -> Any:
    """The config as JSON values (tuples as lists, inf/nan as strings), for the trackers' config records."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return _clean(value)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (what the trackers get)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class _TensorBoard:
    """<run_dir>/tb; the config as a text summary at step 0."""

    def __init__(self, run_dir: Path, config: dict | None, project: str, name: str, offline: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tb"))
        if config is not None:
            self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    """A wandb run (its own, `reinit="create_new"`, so runs in one process do not finish each other), in
    <run_dir>/wandb unless WANDB_DIR is set."""

    def __init__(self, run_dir: Path, config: dict | None, project: str, name: str, offline: bool) -> None:
        if offline:
            os.environ["WANDB_ERROR_REPORTING"] = "false"  # no error reports from wandb-core to W&B's servers
        import wandb

        # dir given each time: wandb reads WANDB_DIR once per process, at its first run
        kwargs: dict[str, Any] = {"project": project, "name": name, "config": config, "reinit": "create_new",
                                  "dir": os.environ.get("WANDB_DIR") or str(run_dir)}
        if offline:
            kwargs["mode"] = "offline"
        self._run = wandb.init(**kwargs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    """A trackio run in its local database (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`)."""

    def __init__(self, run_dir: Path, config: dict | None, project: str, name: str, offline: bool) -> None:
        import trackio

        with _without_env(*(("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL") if offline else ())):
            self._run = trackio.init(project=project, name=name, config=config, embed=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        import trackio
        from trackio import context_vars

        if context_vars.current_run.get() is self._run:
            trackio.finish()  # also forgets it as trackio's current run (else its exit hook finishes it again)
        else:
            self._run.finish()


_TRACKER_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}


def _drop_records_after(path: Path, step: int) -> None:
    """On resume from checkpoint `step`, forget records of later steps (a crash after logging a step but before
    its checkpoint makes the resumed run compute that step again): the log then reads as one uninterrupted run."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)


class RunLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, report_to: tuple[str, ...] = ("tensorboard",),
                 config: dict[str, Any] | None = None, project: str = "dppo", run_name: str = "",
                 trackers_offline: bool = True, tensorboard: bool = True, progress: bool = True, start_step: int = 0,
                 active: bool = True) -> None:
        """report_to: trackers from TRACKERS (the caller has checked they are installed: `LogConfig` does);
        config: the run's config as a dict, logged to each tracker at start; project, run_name ('' = the run
        directory's name), trackers_offline: as `LogConfig`; tensorboard=False removes tensorboard from report_to
        (the older switch)."""
        self.run_dir = Path(run_dir)
        self.active = active
        self._closed = False
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
            _drop_records_after(self.run_dir / name, start_step)
        self._trackers: list[Any] = []
        unknown = [t for t in report_to if t not in TRACKERS]
        if unknown:
            raise ValueError(f"log.report_to: unknown tracker {unknown[0]!r}; valid: {', '.join(TRACKERS)}")
        config = _plain(config) if config is not None else None
        try:
            for name in dict.fromkeys(report_to):
                if name != "tensorboard" or tensorboard:
                    self._trackers.append(_TRACKER_CLASSES[name](self.run_dir, config, project,
                                                                 run_name or self.run_dir.name, trackers_offline))
        except BaseException:
            for tracker in self._trackers:
                tracker.close()
            raise
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._samples = open(self.run_dir / "samples.jsonl", "a", buffering=1)
        self._eval = open(self.run_dir / "eval.jsonl", "a", buffering=1)
        self._progress = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]dppo"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._t0 = time.time()

    @classmethod
    def for_run(cls, run_dir: str | Path, cfg: Any, *, start_step: int = 0, active: bool = True) -> "RunLogger":
        """The logger of a training run with `cfg` (a dppo.train.config.Config): its `log` section's trackers,
        project and run name, the whole config logged to each tracker at start."""
        log = cfg.log
        return cls(run_dir, total_steps=cfg.train.steps, report_to=log.trackers, config=cfg.to_dict(),
                   project=log.project, run_name=log.run_name, trackers_offline=log.trackers_offline,
                   progress=log.progress, start_step=start_step, active=active)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        record = {"step": step, "time": round(time.time() - self._t0, 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._to_trackers(_numbers(metrics), step)
        if self._progress is not None:
            info = f"reward {metrics.get('reward/mean', float('nan')):.3f} | {metrics.get('perf/step_s', float('nan')):.1f}s/step"
            self._progress.update(self._task, completed=step, info=info)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.active:
            return
        for s in samples:
            self._samples.write(json.dumps({"step": step, **s}) + "\n")

    def log_eval(self, step: int, result: dict[str, float]) -> None:
        if not self.active:
            return
        self._eval.write(json.dumps({"step": step, **result}) + "\n")
        self._to_trackers({f"eval/{k}": v for k, v in _numbers(result).items()}, step)

    def _to_trackers(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            for tracker in self._trackers:
                tracker.log(metrics, step)

    def print(self, message: str) -> None:
        if not self.active:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Finish every tracker and close the files (a second call does nothing)."""
        if not self.active or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        for tracker in self._trackers:
            tracker.close()
        for f in (self._metrics, self._samples, self._eval):
            f.close()
