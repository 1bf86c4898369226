"""The loop a reward worker process runs (kept free of torch so a worker starts fast).

RewardRunner starts `python -c "from dppo.rewards.worker import main; main()" FD`, a fresh interpreter that
imports only this package (not the trainer's __main__, as multiprocessing's spawn/forkserver would), and
talks over a socket (fd FD) with multiprocessing's Connection. The worker receives (sys.path, payload),
loads the reward (an import-path spec or a pickled function) and sends ("ready", None), or
("error", traceback) and exits. Then it receives chunks [(index, completion, example), ...] and, for each
item in order, sends (index, reward, None) or (index, None, "ExcType: message"). None, a closed socket, or
the parent process going away ends it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from dppo.rewards.registry import get_reward

Payload = tuple[str, Any]
"""("spec", "module:fn" | "file.py:fn") or ("pickle", bytes)."""


def load_reward(payload: Payload):
    kind, value = payload
    if kind == "spec":
        return get_reward(value)
    return pickle.loads(value)


def warm_up(fn) -> None:
    """Import the modules a reward lists in `fn.worker_imports`, so their import time is not charged to
    the first call's timeout (the built-ins import math-verify / reasoning-gym lazily)."""
    for module in getattr(fn, "worker_imports", ()):
        importlib.import_module(module)


def score_item(fn, completion: str, example) -> tuple[float | None, str | None]:
    """(reward, None), or (None, "ExcType: message") when the call raised or returned a non-number."""
    try:
        return float(fn(completion, example)), None
    except BaseException as err:  # noqa: BLE001 -- a reward may raise anything, SystemExit included
        return None, f"{type(err).__name__}: {err}"[:500]


def _exit_with_parent(parent_pid: int) -> None:
    """Daemon thread: end this process when the parent is gone (even while a reward call hangs)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; it stops the workers itself
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(int(sys.argv[1]))
    try:
        sys_path, payload = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = list(sys_path) + [p for p in sys.path if p not in sys_path]
    worker_loop(conn, payload)


def worker_loop(conn: Connection, payload: Payload) -> None:
    try:
        try:
            fn = load_reward(payload)
            warm_up(fn)
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("ready", None))
        while (chunk := conn.recv()) is not None:
            for index, completion, example in chunk:
                value, error = score_item(fn, completion, example)
                conn.send((index, value, error))
    except (EOFError, OSError):  # the runner closed the socket or went away
        return
