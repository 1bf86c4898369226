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

Files are written through `dppo.run_files.run_dir`: each JSONL line whole, in one write call, unbuffered (a reader of a
live run never sees half a line from a failed write); on resume each JSONL file first loses a torn last line (a
kill mid-write; a warning names the file and the bytes dropped), then the records after the checkpoint's step.
A disk error (full, quota, I/O, read-only) in a log or a tracker is a `RunDirError`; any other error of a tracker
drops that tracker with a warning and the run goes on (metrics.jsonl is the record; trackers never touch it).

With `collapse_warning` each step's record also gets the collapse warning's `warning/*` metrics
(`dppo.run_files.collapse_watch`), and the step it first fires prints one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from dppo.run_files.collapse_watch import CollapseWatch
from dppo.run_files.run_dir import LOGS, JsonlWriter, disk_error, disk_errno, guard, repair_jsonl

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


def _quiet_tensorboard_disk_errors() -> None:
    """TensorBoard writes from a thread; a disk error there is printed by `threading.excepthook` (a traceback on
    stderr) and raised again at the next write, where the logger reports it as a RunDirError. Only that print is
    dropped (installed once; other threads and other errors are printed as before)."""
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "dppo_quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and args.exc_value is not None
                and disk_errno(args.exc_value) is not None):
            previous(args)

    hook.dppo_quiet_tensorboard = True
    threading.excepthook = hook


class _TensorBoard:
    """<run_dir>/tb; the config as a text summary at step 0."""

    folder = "tb"

    def __init__(self, run_dir: Path, config: dict | None, project: str, name: str, offline: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_disk_errors()

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

    folder = "wandb"

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

    folder = "trackio"

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


def line_interval(total_steps: int) -> int:
    """Steps between two progress lines without a terminal: every step up to 100 steps, else one per 1% of the run."""
    return 1 if total_steps <= 100 else max(1, total_steps // 100)


def progress_line(step: int, total: int, metrics: dict[str, Any], step_times: list[float]) -> str:
    """One compact line of a step for a log without a terminal: step, reward, masked share, mismatch (mean binary
    TV between µ and π), step time and the time left (the mean of the last 10 steps' times times the steps left)."""
    def value(name: str, fmt: str) -> str:
        v = metrics.get(name)
        return "-" if not isinstance(v, (int, float)) or v != v else format(v, fmt)

    recent = [t for t in step_times[-10:] if t == t]
    left = (sum(recent) / len(recent)) * max(total - step, 0) if recent else float("nan")
    eta = "-" if left != left else f"{int(left // 60)}m{int(left % 60):02d}s"
    return (f"[dppo] step {step}/{total} | reward {value('reward/mean', '.3f')} | "
            f"masked {value('trust_region/masked_frac', '.2%')} | tv {value('mismatch/binary_tv_mean', '.2e')} | "
            f"{value('perf/step_s', '.1f')} s/step | eta {eta}")


def _earlier_rows(path: Path) -> list[dict[str, Any]]:
    """A resumed run's metrics.jsonl rows (already repaired: whole lines of the steps kept)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, report_to: tuple[str, ...] = ("tensorboard",),
                 config: dict[str, Any] | None = None, project: str = "dppo", run_name: str = "",
                 trackers_offline: bool = True, tensorboard: bool = True, progress: bool = True, start_step: int = 0,
                 active: bool = True, collapse_warning: bool = False) -> None:
        """report_to: trackers from TRACKERS (the caller has checked they are installed: `LogConfig` does);
        config: the run's config as a dict, logged to each tracker at start; project, run_name ('' = the run
        directory's name), trackers_offline: as `LogConfig`; tensorboard=False removes tensorboard from report_to
        (the older switch); collapse_warning: add the collapse warning (a resumed run's earlier steps are read back)."""
        self.run_dir = Path(run_dir)
        self.active = active
        self._closed = False
        if not active:
            return
        with guard(self.run_dir, self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in LOGS:
            repair_jsonl(self.run_dir, self.run_dir / name, keep_step=start_step)
        self._watch = CollapseWatch(rows=_earlier_rows(self.run_dir / LOGS[0])) if collapse_warning else None
        self._trackers: list[Any] = []
        unknown = [t for t in report_to if t not in TRACKERS]
        if unknown:
            raise ValueError(f"log.report_to: unknown tracker {unknown[0]!r}; valid: {', '.join(TRACKERS)}")
        config = _plain(config) if config is not None else None
        try:
            for name in dict.fromkeys(report_to):
                if name != "tensorboard" or tensorboard:
                    cls = _TRACKER_CLASSES[name]
                    with guard(self.run_dir, self.run_dir / cls.folder):
                        self._trackers.append(cls(self.run_dir, config, project, run_name or self.run_dir.name,
                                                  trackers_offline))
            self._metrics, self._samples, self._eval = (JsonlWriter(self.run_dir, self.run_dir / n) for n in LOGS)
        except BaseException:
            self._close_trackers(quiet=True)
            raise
        self._progress = None
        self._lines = progress and not sys.stdout.isatty()  # no terminal (CI, nohup, a log file): a line per step
        self._total, self._line_every = total_steps, line_interval(total_steps)
        self._step_times: list[float] = []
        if progress and not self._lines:
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
                   progress=log.progress, start_step=start_step, active=active,
                   collapse_warning=log.collapse_warning)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        line = None
        if self._watch is not None:
            extra, line = self._watch.update(step, metrics)
            metrics = {**metrics, **extra}
        record = {"step": step, "time": round(time.time() - self._t0, 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(record, fault=f"log@{step}")  # crash tests: killed halfway through this line
        self._to_trackers(_numbers(metrics), step)
        if self._progress is not None:
            info = f"reward {metrics.get('reward/mean', float('nan')):.3f} | {metrics.get('perf/step_s', float('nan')):.1f}s/step"
            self._progress.update(self._task, completed=step, info=info)
        elif self._lines:
            self._step_times.append(float(metrics.get("perf/step_s", float("nan"))))
            if step % self._line_every == 0 or step == self._total:
                print(progress_line(step, self._total, metrics, self._step_times), flush=True)
        if line:
            self.print(line)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.active:
            return
        self._samples.write_lines([{"step": step, **s} for s in samples])

    def log_eval(self, step: int, result: dict[str, float]) -> None:
        if not self.active:
            return
        self._eval.write({"step": step, **result})
        self._to_trackers({f"eval/{k}": v for k, v in _numbers(result).items()}, step)

    def _to_trackers(self, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        for tracker in list(self._trackers):
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # noqa: BLE001 - a disk error stops the run; any other drops the tracker
                self._tracker_failed(tracker, exc)

    def _tracker_failed(self, tracker: Any, exc: Exception) -> None:
        folder = self.run_dir / tracker.folder
        code = disk_errno(exc, folder)
        if code is not None:
            raise disk_error(self.run_dir, folder, code, exc) from exc
        self._trackers.remove(tracker)
        self.print(f"[dppo] warning: tracker {tracker.folder} failed ({type(exc).__name__}: {exc}); it is dropped, "
                   f"the run goes on (metrics.jsonl holds every step)")
        with contextlib.suppress(Exception):
            tracker.close()

    def _close_trackers(self, *, quiet: bool) -> None:
        """Close every tracker; the first disk error is raised after all are closed (none with quiet)."""
        failure = None
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - each tracker gets closed
                code = None if quiet else disk_errno(exc, self.run_dir / tracker.folder)
                if code is not None and failure is None:
                    failure = disk_error(self.run_dir, self.run_dir / tracker.folder, code, exc)
                elif not quiet:
                    print(f"[dppo] warning: closing tracker {tracker.folder} failed ({type(exc).__name__}: {exc})",
                          file=sys.stderr)
        self._trackers = []
        if failure is not None:
            raise failure

    def print(self, message: str) -> None:
        if not self.active:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, flush=True)

    def close(self, *, quiet: bool = False) -> None:
        """Finish every tracker and close the files (a second call does nothing). quiet: after a failure, close
        whatever can be closed and raise nothing (a disk error while finishing a tracker is otherwise raised)."""
        if not self.active or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        for f in (self._metrics, self._samples, self._eval):
            f.close()
        self._close_trackers(quiet=quiet)
