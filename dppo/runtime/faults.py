"""Fault injection for crash tests: `DPPO_FAULT_INJECT="<point>@<step>"` kills the process with SIGKILL when
the trainer reaches `<point>` during training step `<step>` (1-based: the step being computed).

Points: `rollout` (after the engine returned, before rewards), `update` (after the first optimiser step of the
step), `checkpoint` (inside a checkpoint write, after the weights file and before the COMPLETE marker), `log`
(halfway through the append of a metrics.jsonl line), and in an
asynchronous rollout worker (`dppo.rollout.remote`), at the request of step `<step>`: `worker` (the worker is
killed) and `worker_hang` (the worker sleeps for good).
Unset in normal runs; reading one environment variable is the whole cost.
"""

from __future__ import annotations

import os
import signal
import time


def fault_point(name: str, step: int) -> None:
    spec = os.environ.get("DPPO_FAULT_INJECT")
    if spec and spec == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec and spec == f"{name}_hang@{step}":
        while True:
            time.sleep(3600)
