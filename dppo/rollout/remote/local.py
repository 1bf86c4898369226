"""Rollout workers as processes on this machine, weights published through shared memory (rollout.backend local).

    trainer process                                   worker process i (spawned; one per rollout.devices entry)
    ───────────────                                   ──────────────────────────────────────────────────────────
    publish(v, weights) ── copy under lock ──► shared-memory state dict + version v ◄── load if newer, under lock
    submit(i, request)  ── pickled ──────────► requests[i] ──► WorkerCore.run ──► results ── pickled ──► get()

The shared state dict is allocated once (one buffer per tensor, `share_memory_`) and handed to each worker at
start; publishing copies the trainer's weights into it and bumps the version, with no disk and no per-step
allocation. A worker never reads a half-written version: trainer and workers copy under one lock.

Lifecycle: workers are daemonic, ignore SIGINT (Ctrl-C reaches the whole process group; the trainer decides
when they stop), and ask the kernel to SIGKILL them when the trainer dies (PR_SET_PDEATHSIG), so no worker
outlives a killed trainer. `close()` asks each worker to exit, then terminates and kills what is left.
A worker that dies is reported by `get()` with its index, device, pid and exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import signal
import sys
import time
import traceback

import torch

from dppo.rollout.remote.pool import _POLL_S, Pool
from dppo.rollout.remote.worker import Request, Result, WorkerCore, worker_spec
from dppo.runtime.faults import fault_point


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent-pid check of the request loop still ends the worker
        pass


@contextlib.contextmanager
def _main_module_hidden():
    """Start spawned workers without re-running the parent's `__main__` (a script without an
    `if __name__ == "__main__"` guard would otherwise start its training again inside every worker): the worker's
    code lives in dppo, so the parent's main module is not needed there."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _load_latest(core: WorkerCore, shared, version, lock) -> float:
    if version.value <= core.published:
        return 0.0
    with lock:
        return core.load(version.value, shared)


def _worker_main(spec, index, threads, in_flight, shared, version, lock, requests, results, parent_pid) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        core = WorkerCore(spec, index, threads)
        _load_latest(core, shared, version, lock)
        if in_flight:
            core.enable_in_flight(lambda: _load_latest(core, shared, version, lock) > 0)
    except BaseException:  # noqa: BLE001 - reported to the trainer
        results.put(pickle.dumps(Result(-1, index, error=traceback.format_exc())))
        return
    results.put(pickle.dumps(Result(-1, index, version=core.version, info={"pid": os.getpid()})))
    while True:
        try:
            item = requests.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if item is None:
            break
        request: Request = pickle.loads(item)
        fault_point("worker", request.step + 1)
        load_s = _load_latest(core, shared, version, lock)
        results.put(pickle.dumps(core.run(request, load_s)))
    core.close()


class LocalPool(Pool):
    """Worker processes on this machine (see the module docstring)."""

    def __init__(self, specs, devices: list[str], *, threads: int, timeout_s: float, weights: dict, version: int,
                 seed_offset: int = 0, in_flight: bool = False) -> None:
        super().__init__(devices, timeout_s)
        ctx = torch.multiprocessing.get_context("spawn")
        self._shared = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in weights.items()}
        self._version = ctx.Value("q", version)
        self._lock = ctx.Lock()
        self._requests = [ctx.Queue() for _ in devices]
        self._results = ctx.Queue()
        self._procs = []
        for i, device in enumerate(devices):
            proc = ctx.Process(target=_worker_main, name=f"dppo-rollout-{i}", daemon=True,
                               args=(worker_spec(specs, i, device, seed_offset), i, threads, in_flight, self._shared,
                                     self._version, self._lock, self._requests[i], self._results, os.getpid()))
            with _main_module_hidden():
                proc.start()
            self._procs.append(proc)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def publish(self, version: int, weights: dict) -> float:
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            for k, v in weights.items():
                self._shared[k].copy_(v.detach())
            self._version.value = version
        return time.perf_counter() - t0

    def _send(self, worker: int, request: Request) -> None:
        self._requests[worker].put(pickle.dumps(request))

    def _receive(self, timeout: float) -> Result | None:
        try:
            return pickle.loads(self._results.get(timeout=timeout))
        except queue.Empty:
            return None

    def _dead(self) -> tuple[int, str] | None:
        for i, proc in enumerate(self._procs):
            if not proc.is_alive():
                return i, f"died (pid {proc.pid}, exit code {proc.exitcode})"
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for q, proc in zip(self._requests, self._procs):
            if proc.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for q in [*self._requests, self._results]:
            q.cancel_join_thread()
            q.close()
