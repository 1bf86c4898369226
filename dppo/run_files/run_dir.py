"""The one writer of a run directory: every file a run writes (the JSONL logs, config.yaml, summary.json, the
checkpoint files, the exported model) is written through here, so that a full disk, a quota, an I/O error or a
read-only mount stops the run with one `RunDirError` instead of a traceback from deep inside torch or safetensors.

The message names the file, the run directory, the free space left, the newest complete checkpoint (which is
intact: checkpoints are written to a temporary folder and renamed into place) and the command that resumes:

    /r/checkpoints/.tmp_step_000003_41/optimizer.pt: no space left on device (ENOSPC) while writing; 0 B free
    under /r; newest complete checkpoint: /r/checkpoints/step_000002 (intact); free space, then resume with:
    dppo train --resume /r

How each writer keeps what a reader sees whole:
- `JsonlWriter.write`: the record is encoded first and written with one `os.write` on an O_APPEND descriptor (no
  Python buffer to flush later); a write that fails part-way (a full disk) is cut back with `ftruncate`, so a
  failed write leaves no half line. A kill cannot be undone that way: `repair_jsonl` cuts a torn last line on resume.
- `write_atomic`: a temporary sibling file, fsynced, renamed over the target; the old file survives any failure.
- `save_torch`: `torch.save` into a file object that records the OSError its write met, so torch's opaque
  `RuntimeError: [enforce fail at inline_container.cc] unexpected pos` is reported as the disk error it was.

The run directory's layout lives here too, since the messages name it: the JSONL logs (`LOGS`) and the checkpoint
folders (`checkpoint_path`; `complete_checkpoints`: those holding the `MARKER`, written by `dppo.run_files.checkpoint`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from dppo.runtime.faults import fault_point

LOGS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")
"""The JSONL files of a run (`dppo.run_files.logger`): one line per step, per logged sample, per evaluation; fsynced
before each checkpoint."""
MARKER = "COMPLETE"
"""The file written last into a checkpoint folder: a folder without it (a write killed midway) is never loaded."""
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EIO: "input/output error", errno.EROFS: "read-only file system"}
"""The OSError codes that mean "the run directory cannot be written" (not a bug in the run)."""

_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) quote an errno
LOW_SPACE = 1 << 20
"""Free bytes below which a write error with no errno (a library that lost it) is taken for a full disk."""
_write, _open = os.write, open  # every byte this module writes goes through these two (the fault tests patch them)


class RunDirError(RuntimeError):
    """The run directory cannot be written (or a log in it read back); the message says which file, what is
    left, the newest complete checkpoint and how to resume. `dppo train` prints it as one line and exits 1."""


def disk_errno(exc: BaseException, path: Path | None = None) -> int | None:
    """The DISK_ERRNOS code behind `exc` (an OSError, one it was raised from, or an "(os error N)" in its
    message), or ENOSPC for an error without one when less than LOW_SPACE is free at `path`; else None."""
    seen, visited = exc, set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        code = getattr(seen, "errno", None)
        found = _OS_ERROR.search(str(seen))
        code = code if code in DISK_ERRNOS else int(found.group(1)) if found else None
        if code in DISK_ERRNOS:
            return code
        seen = seen.__cause__ or seen.__context__
    if path is not None and isinstance(exc, (OSError, RuntimeError)) and free_bytes(path) < LOW_SPACE:
        return errno.ENOSPC
    return None


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint `step` of a run lives."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders (`dppo.run_files.checkpoint`), oldest first (partial writes and temp folders
    are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def where_to_resume(run_dir: str | Path) -> str:
    """The end of a message: the newest complete checkpoint and the command that resumes from it."""
    newest = newest_checkpoint(run_dir)
    if newest is None:
        return "no complete checkpoint yet; free space, then start the run again"
    return f"newest complete checkpoint: {newest} (intact); free space, then resume with: dppo train --resume {run_dir}"


def disk_error(run_dir: str | Path, path: str | Path, code: int, exc: BaseException | None = None, *,
               advice: str | None = None) -> RunDirError:
    """The RunDirError of disk error `code` at `path`; advice: what to do (default: `where_to_resume`)."""
    name = errno.errorcode.get(code, str(code))
    why = f" ({type(exc).__name__}: {str(exc)[:200]})" if exc is not None and not isinstance(exc, OSError) else ""
    return RunDirError(f"{path}: {DISK_ERRNOS[code]} ({name}) while writing{why}; {human(free_bytes(path))} free "
                       f"under {run_dir}; {advice or where_to_resume(run_dir)}")


@contextlib.contextmanager
def guard(run_dir: str | Path, path: str | Path, *, advice: str | None = None) -> Iterator[None]:
    """Turn a disk error (DISK_ERRNOS) raised while writing `path` into a RunDirError (ending with `advice`, by
    default the newest checkpoint and the resume command); anything else passes."""
    try:
        yield
    except RunDirError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified by its errno; anything else is re-raised as it is
        code = disk_errno(exc, Path(path))
        if code is None:
            raise
        raise disk_error(run_dir, path, code, exc, advice=advice) from exc


def check_space(run_dir: str | Path, folder: str | Path, needed: int, what: str) -> None:
    """RunDirError before writing `what` (about `needed` bytes) into `folder` when the space is not there."""
    free = free_bytes(folder)
    if free < needed:
        raise RunDirError(f"{folder}: not enough space for {what}: it needs about {human(needed)}, "
                          f"{human(free)} free under {run_dir}; nothing was written; {where_to_resume(run_dir)}")


# ------------------------------------------------------------------------------------------------- writers
class JsonlWriter:
    """Appends whole JSON lines to one file (see the module docstring); `run_dir` is named in its errors."""

    def __init__(self, run_dir: str | Path, path: str | Path) -> None:
        self.run_dir, self.path = Path(run_dir), Path(path)
        with guard(self.run_dir, self.path):
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any], *, fault: str | None = None) -> None:
        self.write_lines([record], fault=fault)

    def write_lines(self, records: list[dict[str, Any]], *, fault: str | None = None) -> None:
        """All of `records` in one write call (the samples of a step appear together or not at all). fault: the
        crash tests' point (`DPPO_FAULT_INJECT="<fault>"`): half the bytes are written, then the process is killed."""
        if not records:
            return
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        if fault is not None and os.environ.get("DPPO_FAULT_INJECT") == fault:
            _write(self._fd, data[: len(data) // 2])
            fault_point(*fault.split("@"))
        with guard(self.run_dir, self.path):
            size = os.fstat(self._fd).st_size
            try:
                done = _write(self._fd, data)
                while done < len(data):  # a short write: the next call reports why (or finishes the line)
                    done += _write(self._fd, data[done:])
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no half line left behind
                raise

    def fsync(self) -> None:
        if self._fd is not None:
            with guard(self.run_dir, self.path):
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def write_atomic(run_dir: str | Path, path: str | Path, content: str | bytes | Callable[[Path], Any]) -> Path:
    """Write `path` whole or not at all: `content` (text, bytes, or a function writing the file it is given) goes
    to a temporary sibling, which is fsynced and renamed over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with guard(run_dir, path):
            if callable(content):
                content(tmp)
            else:
                write_file(run_dir, tmp, content)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def write_file(run_dir: str | Path, path: str | Path, content: str | bytes) -> None:
    """Write `path` (not atomically: for files inside a folder that is renamed into place when complete)."""
    with guard(run_dir, path), _open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)


class _ErrnoFile(io.RawIOBase):
    """A writable file that remembers the OSError its write raised (torch.save turns it into a RuntimeError)."""

    def __init__(self, f) -> None:
        self._f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise


def save_torch(run_dir: str | Path, obj: Any, path: str | Path) -> None:
    """`torch.save(obj, path)`; a disk error on the way is a RunDirError naming `path`."""
    import torch

    with guard(run_dir, path), _open(path, "wb") as f:
        sink = _ErrnoFile(f)
        try:
            torch.save(obj, sink)
        except Exception as exc:
            if sink.error is not None:
                raise sink.error from exc
            raise


def save_safetensors(run_dir: str | Path, tensors: dict, path: str | Path) -> None:
    """`safetensors.torch.save_file`; its "(os error 28)" becomes a RunDirError naming `path`."""
    from safetensors.torch import save_file

    with guard(run_dir, path):
        save_file(tensors, str(path), metadata={"format": "pt"})


def repair_jsonl(run_dir: str | Path, path: Path, *, keep_step: int | None = None, warn=None) -> None:
    """On resume: cut a torn last line (a write cut off by a kill; warned, naming the file and the bytes dropped),
    then, with `keep_step`, drop the records of later steps (a crash after logging a step but before its
    checkpoint makes the resumed run compute that step again: the log then reads as one uninterrupted run).
    A damaged line before the end is a RunDirError naming the file and line."""
    if not path.is_file():
        return
    warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        warn(f"[dppo] warning: {path}: dropped {len(data) - len(whole)} bytes of a torn last line "
             f"(the run stopped while writing it)")
    keep, lines = [], whole.decode("utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{path}: line {lineno}: not valid JSON ({exc}); the log is damaged before its last "
                              f"line: fix or delete that line, then resume with: dppo train --resume {run_dir}"
                              ) from None
        if keep_step is None or not isinstance(record, dict) or record.get("step", 0) <= keep_step:
            keep.append(line)
    if len(whole) != len(data) or len(keep) != len(lines):
        write_atomic(run_dir, path, "".join(line + "\n" for line in keep))
