"""Rollout workers as Ray actors (rollout.backend ray): the workers can live on other nodes of a Ray cluster.

Why Ray: it is what verl, NeMo-RL and OpenRLHF place their rollout workers with, it schedules actors on the
nodes that have the resources (a CPU, or a GPU for a `cuda` device), and its object store moves the published
weights to every node. dppo adds no network layer of its own (docs/async.md).

    trainer (Ray driver)                                    actor i (one per rollout.devices entry, SPREAD)
    publish(v, weights) ── ray.put once per version ──► object store ──► (sent with the next request)
    submit(i, request)  ── actor.run(request, v, ref) ──────────────────► load v if newer, WorkerCore.run
    get()               ◄── ray.wait over the pending calls ─────────────── Result

Each request carries the newest version's object reference when the actor has not seen that version yet, so an
actor loads a version at most once, between two requests, and a request submitted when version v was published
is sampled with version >= v (the same bound as the local transport). Ray sets CUDA_VISIBLE_DEVICES for an
actor that asks for a GPU, so a `cuda:N` entry means "one GPU" here and the actor uses its `cuda:0`.

`rollout.ray_address` '' starts a Ray instance on this machine (stopped again by `close`); 'auto' or host:port
joins a running cluster, whose nodes must each have the project installed (and the model folder, for a model
loaded by path). An actor that dies is reported with its index, device and node.
"""

from __future__ import annotations

import os
import time

from dppo.rollout.remote.pool import Pool, WorkerError
from dppo.rollout.remote.worker import Request, Result, WorkerCore, worker_spec
from dppo.runtime.faults import fault_point


class _Actor:
    """The Ray actor: a WorkerCore plus the version bookkeeping."""

    def __init__(self, spec, index: int, threads: int) -> None:
        self.core = WorkerCore(spec, index, threads)

    def ready(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()[:12]}

    def run(self, request: Request, version: int, weights) -> Result:
        fault_point("worker", request.step + 1)
        load_s = self.core.load(version, weights) if weights is not None and version > self.core.published else 0.0
        return self.core.run(request, load_s)

    def close(self) -> None:
        self.core.close()


class RayPool(Pool):
    """Ray actors (see the module docstring)."""

    def __init__(self, specs, devices: list[str], *, threads: int, timeout_s: float, weights: dict, version: int,
                 seed_offset: int = 0, address: str = "", in_flight: bool = False) -> None:
        import ray

        super().__init__(devices, timeout_s)
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("DPPO_")}})
        self._pending: dict = {}  # object ref -> worker index
        self._sent = [-1] * len(devices)  # newest version each actor has been sent
        self._version, self._ref = -1, None
        self.publish(version, weights)
        actor_cls = ray.remote(_Actor)
        self._actors = []
        for i, device in enumerate(devices):
            resources = {"num_gpus": 1, "num_cpus": 1} if device.startswith("cuda") else {"num_cpus": 1}
            self._actors.append(actor_cls.options(name=None, scheduling_strategy="SPREAD", max_restarts=0,
                                                  **resources).remote(worker_spec(specs, i, "cuda" if device.startswith("cuda") else device,
                                                                      seed_offset), i, threads))
        try:
            self._wait_ready_ray()
        except BaseException:
            self.close()
            raise

    def _wait_ready_ray(self) -> None:
        ray = self._ray
        refs = {a.ready.remote(): i for i, a in enumerate(self._actors)}
        start = time.monotonic()
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in done:
                i = refs.pop(ref)
                try:
                    self.info[i] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the actor's constructor failed or it died
                    raise WorkerError(f"{self.name(i)} failed to start:\n{exc}") from None
            if refs and time.monotonic() - start > self.timeout_s:
                names = ", ".join(self.name(i) for i in sorted(refs.values()))
                raise WorkerError(f"{names}: not started after {self.timeout_s:g} s (rollout.worker_timeout_s; "
                                   f"does the cluster have a free CPU/GPU for each worker?)")

    def publish(self, version: int, weights: dict) -> float:
        t0 = time.perf_counter()
        self._version, self._ref = version, self._ray.put({k: v.detach().cpu() for k, v in weights.items()})
        return time.perf_counter() - t0

    def _send(self, worker: int, request: Request) -> None:
        fresh = self._sent[worker] < self._version
        ref = self._actors[worker].run.remote(request, self._version, self._ref if fresh else None)
        self._sent[worker] = self._version
        self._pending[ref] = worker

    def _receive(self, timeout: float) -> Result | None:
        if not self._pending:
            time.sleep(timeout)
            return None
        done, _ = self._ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        if not done:
            return None
        worker = self._pending.pop(done[0])
        try:
            return self._ray.get(done[0])
        except self._ray.exceptions.RayActorError as exc:
            return Result(-2, worker, error=f"died ({type(exc).__name__}: {exc})")

    def _dead(self) -> tuple[int, str] | None:
        return None  # a dead actor's pending call fails with RayActorError (see _receive)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for actor in getattr(self, "_actors", []):
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._pending.clear()
        self._ref = None
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
