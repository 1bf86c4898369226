"""What every rollout-worker transport shares: the start-up handshake, submission bookkeeping, and the rules that
turn a dead, failing or silent worker into a clear error naming it (never a hang).

A transport subclasses `Pool` and implements `_send`, `_receive`, `_dead`, `publish` and `close`.
"""

from __future__ import annotations

import time

from dppo.rollout.remote.worker import Request, Result

_POLL_S = 0.5


class WorkerError(RuntimeError):
    """A rollout worker died, failed, or returned nothing within rollout.worker_timeout_s."""


class Pool:
    def __init__(self, devices: list[str], timeout_s: float) -> None:
        self.devices, self.timeout_s, self.closed = list(devices), timeout_s, False
        self.info: list[dict] = [{} for _ in devices]
        self._outstanding = [0] * len(devices)
        self._progress = [time.monotonic()] * len(devices)

    # ------------------------------------------------------------------ the transport's part
    def publish(self, version: int, weights: dict) -> float:
        """Make `weights` (a state dict) the newest version; returns the seconds the trainer spent on it."""
        raise NotImplementedError

    def _send(self, worker: int, request: Request) -> None:
        raise NotImplementedError

    def _receive(self, timeout: float) -> Result | None:
        raise NotImplementedError

    def _dead(self) -> tuple[int, str] | None:
        """(index, why) of a worker that is gone, or None."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def name(self, worker: int) -> str:
        extra = "".join(f", {k} {v}" for k, v in self.info[worker].items())
        return f"rollout worker {worker} ({self.devices[worker]}{extra})"

    def submit(self, worker: int, request: Request) -> None:
        if self._outstanding[worker] == 0:
            self._progress[worker] = time.monotonic()
        self._outstanding[worker] += 1
        self._send(worker, request)

    def get(self, timeout: float) -> Result | None:
        """The next result (None after `timeout` s). Raises WorkerError for a failed request, a dead worker, or a
        worker with requests outstanding that returned nothing for rollout.worker_timeout_s."""
        deadline = time.monotonic() + timeout
        while True:
            result = self._receive(min(_POLL_S, max(0.0, deadline - time.monotonic())))
            now = time.monotonic()
            if result is not None:
                self._outstanding[result.worker] -= 1
                self._progress[result.worker] = now
                if result.error:
                    raise WorkerError(f"{self.name(result.worker)} failed:\n{result.error}")
                return result
            self._check(now)
            if now >= deadline:
                return None

    def _check(self, now: float) -> None:
        dead = self._dead()
        if dead is not None:
            raise WorkerError(f"{self.name(dead[0])} {dead[1]}")
        for w, n in enumerate(self._outstanding):
            if n and now - self._progress[w] > self.timeout_s:
                raise WorkerError(f"{self.name(w)} returned nothing for {self.timeout_s:g} s with {n} request(s) "
                                  f"outstanding (rollout.worker_timeout_s): it is hung or far too slow")

    def _wait_ready(self) -> None:
        """Wait for every worker's start-up handshake (a Result with id -1 carrying its info)."""
        pending, start = set(range(len(self.devices))), time.monotonic()
        while pending:
            result = self._receive(_POLL_S)
            if result is not None:
                if result.error:
                    raise WorkerError(f"{self.name(result.worker)} failed to start:\n{result.error}")
                self.info[result.worker] = result.info
                pending.discard(result.worker)
                continue
            dead = self._dead()
            if dead is not None:
                raise WorkerError(f"{self.name(dead[0])} {dead[1]} while starting")
            if time.monotonic() - start > self.timeout_s:
                names = ", ".join(self.name(w) for w in sorted(pending))
                raise WorkerError(f"{names}: not started after {self.timeout_s:g} s (rollout.worker_timeout_s)")
