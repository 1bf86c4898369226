"""Run logging: metrics.jsonl (one JSON line per step), TensorBoard, samples.jsonl, eval.jsonl, a rich bar.

Only the logger touches files and the terminal; the trainer hands it plain Python numbers once per step.
In a multi-process run only rank 0's logger is active; the others' (`active=False`) write and print nothing.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


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
    def __init__(self, run_dir: str | Path, *, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 start_step: int = 0, active: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.active = active
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
            _drop_records_after(self.run_dir / name, start_step)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._samples = open(self.run_dir / "samples.jsonl", "a", buffering=1)
        self._eval = open(self.run_dir / "eval.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._progress = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]dppo"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._t0 = time.time()

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        record = {"step": step, "time": round(time.time() - self._t0, 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
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
        if self._tb is not None:
            for key, value in result.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"eval/{key}", value, step)

    def print(self, message: str) -> None:
        if not self.active:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        for f in (self._metrics, self._samples, self._eval):
            f.close()
