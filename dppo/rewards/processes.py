"""Isolation "process": a persistent pool of worker processes; a call past the limit gets its worker killed.

Each worker is a fresh interpreter running `dppo.rewards.worker` (it imports dppo's reward code and the
reward's module, never the trainer's __main__ or torch), connected by a socket pair. The batch is cut into one
chunk per worker (one message per chunk plus one small message per result); an item's clock starts when its
worker begins it. A worker past the limit is killed (SIGKILL), its item counted as a timeout, the rest of its
chunk re-queued, and the worker replaced; a worker that dies fails its current item the same way. The
reward must be loadable in the worker: a function in an importable module, an import-path spec, or a file
loaded by `get_reward` (not a lambda, a local function or one defined in a script's __main__).

Workers start on the first call (or `start()`) and are reused; `close()` (or garbage collection,
interpreter exit) stops them, and a worker exits by itself within a second when this process dies.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from pathlib import Path

from dppo.example import Example, RewardFn
from dppo.rewards.registry import SPEC_ATTRIBUTE
from dppo.rewards.strategy import Outcomes
from dppo.rewards.worker import Payload

WORKER_COMMAND = "from dppo.rewards.worker import main; main()"
POLL_S = 1.0
"""Longest wait between liveness checks of the workers."""


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    dead: bool = False
    inflight: deque[int] = field(default_factory=deque)
    """Indices sent and not yet answered, in the order the worker runs them."""
    item_start: float = 0.0
    """When the worker began inflight[0]."""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


def _start_worker(payload: Payload) -> _Worker:
    """A fresh interpreter running dppo.rewards.worker, connected by a socket pair."""
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # so `dppo` imports even when not installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with child_sock:
        command = [sys.executable, "-c", WORKER_COMMAND, str(child_sock.fileno())]
        process = subprocess.Popen(command, pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL)
    conn = Connection(parent_sock.detach())
    conn.send((list(sys.path), payload))
    return _Worker(process=process, conn=conn, started=time.monotonic())


def _stop_workers(pool: list[_Worker]) -> None:
    for w in pool:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 1.0
    for w in pool:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    pool.clear()


def _payload(fn: RewardFn, name: str) -> Payload:
    """How a worker loads `fn`: by its import-path spec, else pickled. ValueError if neither can work."""
    spec = getattr(fn, SPEC_ATTRIBUTE, None)
    if spec is not None:
        return ("spec", spec)
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"reward {name!r} is defined in __main__, which worker processes do not import; move it to a module, "
            "pass 'path/to/file.py:fn', or use isolation='thread'"
        )
    try:
        return ("pickle", pickle.dumps(fn))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise ValueError(
            f"reward {name!r} cannot be sent to a worker process ({err}); define it at module level, pass an "
            "import path ('module:fn' or 'file.py:fn'), or use isolation='thread'"
        ) from err


class ProcessStrategy:
    """`workers` worker processes, started on first use and reused across calls until `close()`."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, workers: int, startup_timeout_s: float):
        self.name = name
        self.timeout_s = timeout_s
        self.workers = workers
        self.startup_timeout_s = startup_timeout_s
        self._payload = _payload(fn, name)
        self._pool: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._pool)

    def start(self) -> None:
        """Start the workers and wait until they have loaded the reward (RuntimeError if one cannot)."""
        self._fill_pool()
        while not all(w.ready for w in self._pool):
            self._wait()
            self._check_workers(deque(), None)
            self._fill_pool()

    def run(self, completions: Sequence[str], examples: Sequence[Example], out: Outcomes) -> None:
        pending: deque[int] = deque(range(len(examples)))
        while out.remaining:
            self._fill_pool()
            self._dispatch(pending, completions, examples, out)
            self._wait()
            self._check_workers(pending, out)

    def close(self) -> None:
        _stop_workers(self._pool)

    def _check_workers(self, pending: deque[int], out: Outcomes | None) -> None:
        """Read what the workers sent; replace the dead and the late (their current item fails / times out)."""
        for w in list(self._pool):
            self._drain(w, out)
            if w.dead or not w.alive():
                self._drain(w, out)
                self._replace(w, pending, out, died=True)
            elif not w.ready and time.monotonic() - w.started > self.startup_timeout_s:
                self._replace(w, pending, out, died=False)
                raise RuntimeError(f"reward worker for {self.name!r} did not start in {self.startup_timeout_s} s")
            elif w.inflight and time.monotonic() - w.item_start > self.timeout_s:
                self._replace(w, pending, out, died=False)

    def _fill_pool(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_start_worker(self._payload))

    def _dispatch(self, pending: deque[int], completions, examples, out: Outcomes) -> None:
        idle = [w for w in self._pool if w.ready and not w.inflight and not w.dead]
        starting = sum(not w.ready for w in self._pool)
        for w in idle:
            if not pending:
                return
            share = math.ceil(len(pending) / (len(idle) + starting))
            chunk = [pending.popleft() for _ in range(min(share, len(pending)))]
            try:
                w.conn.send([(i, completions[i], examples[i]) for i in chunk])
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                for i in chunk:
                    out.result(i, None, f"cannot send the example to a worker: {err}")
                continue
            except OSError:
                pending.extendleft(reversed(chunk))
                w.dead = True
                continue
            w.inflight.extend(chunk)
            w.item_start = time.monotonic()

    def _wait(self) -> None:
        now = time.monotonic()
        deadlines = [w.item_start + self.timeout_s for w in self._pool if w.inflight]
        deadlines += [w.started + self.startup_timeout_s for w in self._pool if not w.ready]
        timeout = min(max(0.0, min(deadlines, default=now + POLL_S) - now), POLL_S)
        wait_for([w.conn for w in self._pool], timeout)

    def _drain(self, w: _Worker, out: Outcomes | None) -> None:
        try:
            while not w.dead and w.conn.poll():
                message = w.conn.recv()
                if not w.ready:
                    kind, detail = message
                    if kind == "error":
                        w.kill()
                        self._pool.remove(w)
                        raise RuntimeError(f"reward worker could not load reward {self.name!r}:\n{detail}")
                    w.ready = True
                    continue
                index, value, error = message
                if index in w.inflight:
                    w.inflight.remove(index)
                out.result(index, value, error)
                w.item_start = time.monotonic()
        except (EOFError, OSError):
            w.dead = True

    def _replace(self, w: _Worker, pending: deque[int], out: Outcomes | None, *, died: bool) -> None:
        """Kill `w` (replaced on the next round); its current item fails if it died, else times out; the rest
        of its chunk is re-queued."""
        w.kill()
        self._pool.remove(w)
        if not w.ready and died:
            raise RuntimeError(
                f"reward worker for {self.name!r} exited while starting (exit code {w.process.poll()}); "
                "its stderr says why"
            )
        if w.inflight:
            current = w.inflight.popleft()
            if died:
                out.result(current, None, f"reward worker died (exit code {w.process.returncode})")
            else:
                out.timeout(current)
            pending.extendleft(reversed(w.inflight))
