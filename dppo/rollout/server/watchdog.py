"""No process of a server outlives the process it hangs from: the watchdog every process of a dppo server runs.

A server dppo starts is a process group of its own (`dppo.rollout.server.launch`): vLLM's API server (the group's
leader, started by dppo), its engine core (started by the API server), the engine core's worker, and
multiprocessing's resource tracker. Each of the first three runs `watch_parent` (the API server from
`dppo.rollout.server.serve`, the others when vLLM loads dppo's plugin in them, `dppo.rollout.server.plugin`): a
daemon thread that notes its parent and, when that parent is gone — the process is re-parented, whatever killed it,
SIGKILL included — kills the whole group with SIGKILL. So whichever of dppo, the API server or the engine core
dies first, the rest of that server follows within `POLL_S`; nothing is left holding memory (or a GPU) after it.

It acts only in a server's group: the API server sets `GROUP_ENV` for its children, and a process without it (dppo's
own in-process vLLM engine, which loads the same plugin) never starts a watchdog.
"""

from __future__ import annotations

import os
import signal
import threading
import time

GROUP_ENV = "DPPO_SERVER_GROUP"
"""Set (to the group's id) in the environment of a server's processes: the watchdog runs only where it is."""
POLL_S = 0.5
_started = False


def watch_parent(parent: int | None = None) -> None:
    """Start this process's watchdog (once): SIGKILL to its process group when `parent` (default: the parent it has
    now) is no longer its parent. A no-op outside a dppo server's group."""
    global _started
    group = os.environ.get(GROUP_ENV)
    if _started or group is None or int(group) != os.getpgrp():
        return
    _started = True
    parent = os.getppid() if parent is None else parent
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="dppo-parent-watchdog").start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)
