"""A graceful stop on SIGINT/SIGTERM: the training loop finishes the step it is in, checkpoints it and returns; a
second signal acts at once."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class GracefulStop:
    """While active, the first SIGINT/SIGTERM only records `signum`: the loop finishes its step, checkpoints and
    returns. The handlers that were there before come back at once, so a second signal acts as usual (Ctrl-C
    raises KeyboardInterrupt, SIGTERM terminates; a half-written checkpoint is never loaded). Off the main
    thread, where Python cannot install handlers, it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                self._previous[sig] = signal.SIG_DFL if previous is None else previous
        return self

    def _handle(self, signum: int, frame) -> None:
        self.signum = signum
        self._restore()
        os.write(2, f"\n[dppo] {signal.Signals(signum).name}: stopping after the current step "
                    f"(send it again to stop now)\n".encode())

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc) -> None:
        self._restore()

