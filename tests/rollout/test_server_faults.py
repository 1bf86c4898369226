"""Faults of the vLLM servers dppo starts, on a tiny seeded random model.

Nothing of a server outlives what killed it: whichever process dies first — the server's API process, its engine
core, or the process that started it (kill -9, or a crash that never reaches `close`) — every process of the
server's group (API server, engine core, its worker, multiprocessing's resource tracker) is gone within seconds,
with nobody calling `ServerProcess.stop`. (A run going on when a server dies: test_server_recovery.py.)

The SIGKILLs of vLLM's own processes (the API process, then the restarted server's engine core) run on real vLLM in
test_server_recovery.py, between which the same server is restarted (a start costs ~25-30 s on 2 cores);
`stop` and the death of the owner are dppo's logic and run on the fake server (`fake_vllm_server.py`: an API
process, an "engine core" and its "worker", each with dppo's watchdog, like a vLLM server with dppo's plugin).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from server_processes import (engine_core, fake_vllm, group, model_dir, start,  # noqa: F401 (fixtures)
                              wait_gone)

pytestmark = pytest.mark.slow  # (each test starts a fake server: seconds)


def test_stop_kills_what_is_left_of_a_server_whose_api_process_died(fake_vllm, model_dir, tmp_path):
    """`ServerProcess.stop` after the API process has exited still kills the rest of its group (it used to return
    as soon as the process it started had exited). On the fake server."""
    proc = start(model_dir, tmp_path)
    core = engine_core(proc.pid)
    core.suspend()  # (its watchdog cannot act: only stop() can end it)
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait(10)
    proc.stop()
    assert wait_gone(proc.pid, 5.0) == []


_OWNER = textwrap.dedent("""
    import os, sys, time
    from dppo.rollout import make_engine
    from dppo.rollout.settings import VLLMServerSettings
    eng = make_engine("vllm-server", sys.argv[1], settings=VLLMServerSettings(kv_cache_gb=0.25), log_dir=sys.argv[2])
    print(eng.processes[0].pid, flush=True)
    if sys.argv[3] == "crash":
        sys.stdin.readline()
        raise SystemExit("the owner crashes without closing its engine")
    time.sleep(600)
""")


@pytest.mark.parametrize("death", ["sigkill", "crash"])
def test_no_server_outlives_its_owner(fake_vllm, model_dir, tmp_path, death):
    """The process that started the server dies — by SIGKILL, or by an exception that never closes the engine:
    the server's whole group is gone within seconds. On the fake server (the owner inherits DPPO_SERVER_ENTRY)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(model_dir), str(tmp_path), death],
                             stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        pgid = int(owner.stdout.readline())
        assert len(group(pgid)) >= 3
        if death == "sigkill":
            owner.kill()
        else:
            owner.stdin.write("\n")
            owner.stdin.flush()
        owner.wait(60)
    finally:
        owner.kill()
        owner.wait()
    assert wait_gone(pgid) == [], "the server outlived the process that started it"
