"""RewardRunner: score a batch of completions with a per-call timeout, exception capture and isolation.

A reward that raises, returns a non-number, crashes its worker, or runs past `timeout_s` gives 0.0 for that
completion and is counted (`failures`: raised / non-number / worker died; `timeouts`: past the limit).
A NaN or infinite reward is a bug, not a miss: it raises ValueError naming the reward (and task).

Isolation modes:
- "process": a persistent pool of `workers` worker processes, each a fresh interpreter running
  `dppo.rewards.worker` (it imports dppo's reward code and the reward's module, never the trainer's
  __main__ or torch). The batch is cut into one chunk per worker (one message per chunk plus one small
  message per result); an item's clock starts when its worker begins it. A worker past the limit is killed
  (SIGKILL), its item counted as a timeout, the rest of its chunk re-queued, and the worker replaced. The
  reward must be loadable in the worker: a function in an importable module, an import-path spec, or a file
  loaded by `get_reward` (not a lambda, a local function or one defined in a script's __main__).
- "thread": daemon threads; a timed-out call is abandoned (it keeps running but its result is dropped) and
  its thread replaced. Cheap, but a reward that never returns keeps a CPU busy.
- "none": in the calling thread, no timeout (for trusted built-ins: pure string code).
Default (`isolation=None`): `dppo.rewards.default_isolation` ("none" for exact_match / last_number /
leading_number, "process" for everything else).
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from pathlib import Path

import torch

from dppo.rewards import SPEC_ATTRIBUTE, default_isolation, get_reward
from dppo.rewards.worker import Payload, score_item, warm_up
from dppo.example import Example, RewardFn

ISOLATIONS = ("process", "thread", "none")
MAX_ERRORS_KEPT = 8
WORKER_COMMAND = "from dppo.rewards.worker import main; main()"
POLL_S = 1.0
"""Longest wait between liveness checks of the workers."""


class _Outcomes:
    """Per-item results of one runner call: value (None until done), plus counters and a few messages."""

    def __init__(self, examples: Sequence[Example], timeout_s: float):
        self.examples = examples
        self.timeout_s = timeout_s
        self.values: list[float | None] = [None] * len(examples)
        self.done = [False] * len(examples)
        self.remaining = len(examples)
        self.failures = 0
        self.timeouts = 0
        self.errors: list[str] = []

    def _finish(self, index: int, value: float | None, message: str | None) -> None:
        if self.done[index]:
            return
        self.done[index] = True
        self.remaining -= 1
        self.values[index] = value
        if message is not None and len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"example {self.examples[index].uid}: {message}")

    def result(self, index: int, value: float | None, error: str | None) -> None:
        if error is not None and not self.done[index]:
            self.failures += 1
        self._finish(index, value if error is None else 0.0, error)

    def timeout(self, index: int) -> None:
        if not self.done[index]:
            self.timeouts += 1
        self._finish(index, 0.0, f"timed out after {self.timeout_s:g} s")


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


class NonFiniteRewardError(ValueError):
    """A reward returned NaN or ±inf: a bug in the reward, not a wrong answer. The message names the reward,
    the task and the example. The trainer skips the step's update (weights untouched) and counts it."""


class RewardRunner:
    """Scores (completion, example) pairs: `runner(completions, examples) -> (rewards [B] float32, stats)`.

    stats = {"failures": int, "timeouts": int} for this call; `last_errors` keeps up to 8 messages of the
    last call. Worker processes start on the first call (or `start()`) and are reused; `close()` (or leaving
    a `with` block, garbage collection, interpreter exit) stops them, and a worker exits by itself within a
    second when this process dies.
    """

    def __init__(
        self,
        fn: RewardFn | str,
        *,
        timeout_s: float = 10.0,
        workers: int | None = None,
        isolation: str | None = None,
        name: str | None = None,
        task: str | None = None,
        startup_timeout_s: float = 120.0,
    ):
        """fn: a reward or a name/import path (`get_reward`). timeout_s: limit per call (per completion).
        workers: processes/threads (default min(4, CPU count)). isolation: "process" | "thread" | "none"
        (None: `default_isolation(fn)`). name / task: used in error messages. startup_timeout_s: limit on a
        worker's start (interpreter start plus importing the reward's module), not counted in timeout_s.
        """
        self.fn = get_reward(fn)
        default_name = getattr(self.fn, SPEC_ATTRIBUTE, None) or getattr(self.fn, "__qualname__", repr(self.fn))
        self.name = name or (fn if isinstance(fn, str) else default_name)
        self.task = task
        self.isolation = isolation or default_isolation(self.fn)
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.workers = workers or min(4, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.startup_timeout_s = startup_timeout_s
        self.last_errors: list[str] = []
        self._pool: list[_Worker] = []
        if self.isolation == "process":
            self._payload = _payload(self.fn, self.name)
            self._finalizer = weakref.finalize(self, _stop_workers, self._pool)
        else:
            warm_up(self.fn)

    # -- public -------------------------------------------------------------------------------------------

    def __call__(self, completions: Sequence[str], examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, int]]:
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions for {len(examples)} examples")
        out = _Outcomes(examples, self.timeout_s)
        if self.isolation == "process":
            try:
                self._run_process(completions, examples, out)
            except BaseException:  # e.g. Ctrl-C mid-call: results still in flight must not reach a later call
                self.close()
                raise
        elif self.isolation == "thread":
            self._run_threads(completions, examples, out)
        else:
            for i, (completion, example) in enumerate(zip(completions, examples)):
                out.result(i, *score_item(self.fn, completion, example))
        self.last_errors = out.errors
        self._check_finite(out.values, completions, examples)
        rewards = torch.tensor(out.values, dtype=torch.float32)
        return rewards, {"failures": out.failures, "timeouts": out.timeouts}

    def start(self) -> None:
        """Start the worker processes now and wait until they have loaded the reward (raises RuntimeError if
        one cannot). Optional: the first call starts them otherwise. No-op for isolation "thread" / "none"."""
        if self.isolation != "process":
            return
        self._fill_pool()
        while not all(w.ready for w in self._pool):
            self._wait()
            self._check_workers(deque(), None)
            self._fill_pool()

    def close(self) -> None:
        _stop_workers(self._pool)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_finite(self, values, completions, examples) -> None:
        for value, completion, example in zip(values, completions, examples):
            if not math.isfinite(value):
                where = f" (task {self.task!r})" if self.task else ""
                raise NonFiniteRewardError(
                    f"reward {self.name!r}{where} returned {value} for example {example.uid!r} "
                    f"(completion {completion[:80]!r}); non-finite rewards are rejected"
                )

    # -- threads ------------------------------------------------------------------------------------------

    def _run_threads(self, completions, examples, out: _Outcomes) -> None:
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(examples)):
            todo.put(i)
        results: queue.SimpleQueue[tuple[int, float | None, str | None]] = queue.SimpleQueue()
        slots = [_ThreadSlot(self.fn, completions, examples, todo, results) for _ in range(self.workers)]
        while out.remaining:
            now = time.monotonic()
            deadlines = [s.deadline(self.timeout_s) for s in slots]
            wait = min([d for d in deadlines if d is not None], default=now + 1.0) - now
            try:
                out.result(*results.get(timeout=max(wait, 0.0)))
                continue
            except queue.Empty:
                pass
            for k, slot in enumerate(slots):
                index = slot.abandon_if_late(self.timeout_s)
                if index is not None:
                    out.timeout(index)
                    slots[k] = _ThreadSlot(self.fn, completions, examples, todo, results)
        for slot in slots:
            slot.stop()

    # -- processes ----------------------------------------------------------------------------------------

    def _run_process(self, completions, examples, out: _Outcomes) -> None:
        pending: deque[int] = deque(range(len(examples)))
        while out.remaining:
            self._fill_pool()
            self._dispatch(pending, completions, examples, out)
            self._wait()
            self._check_workers(pending, out)

    def _check_workers(self, pending: deque[int], out: _Outcomes | None) -> None:
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

    def _dispatch(self, pending: deque[int], completions, examples, out: _Outcomes) -> None:
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

    def _drain(self, w: _Worker, out: _Outcomes | None) -> None:
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

    def _replace(self, w: _Worker, pending: deque[int], out: _Outcomes | None, *, died: bool) -> None:
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


class _ThreadSlot:
    """One daemon thread taking indices from `todo`; abandoned (never joined) when a call runs too long."""

    def __init__(self, fn, completions, examples, todo, results):
        self._lock = threading.Lock()
        self._current: tuple[int, float] | None = None
        self._abandoned = False
        args = (fn, completions, examples, todo, results)
        self._thread = threading.Thread(target=self._loop, args=args, daemon=True)
        self._thread.start()

    def _loop(self, fn, completions, examples, todo, results) -> None:
        while True:
            with self._lock:
                if self._abandoned:
                    return
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    self._current = None
                    return
                self._current = (index, time.monotonic())
            value, error = score_item(fn, completions[index], examples[index])
            with self._lock:
                self._current = None
                if self._abandoned:
                    return
                results.put((index, value, error))

    def deadline(self, timeout_s: float) -> float | None:
        current = self._current
        return None if current is None else current[1] + timeout_s

    def abandon_if_late(self, timeout_s: float) -> int | None:
        with self._lock:
            if self._current is None or time.monotonic() - self._current[1] <= timeout_s:
                return None
            self._abandoned = True
            return self._current[0]

    def stop(self) -> None:
        with self._lock:
            self._abandoned = True
