"""Faults of the vLLM servers dppo starts, on a tiny seeded random model.

Nothing of a server outlives what killed it: whichever process dies first — the server's API process, its engine
core, or the process that started it (kill -9, or a crash that never reaches `close`) — every process of the
server's group (API server, engine core, its worker, multiprocessing's resource tracker) is gone within seconds,
with nobody calling `ServerProcess.stop`. And a run goes on when a server dies: `dppo.rollout.server.fleet_state`
retries the requests on the servers left and restarts the dead one with the current weights.

Each test here starts servers of its own (a start costs ~40 s on 2 cores): slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import VLLM_MARKS

from dppo.rollout.server.client import ServerClient
from dppo.rollout.server.launch import ServerLaunch, ServerProcess

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

VLLM_TINY = dict(num_heads=2, num_kv_heads=1)
KV_GB = 0.25
GONE_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def model_dir(make_tiny_model, tokenizer, tmp_path_factory):
    from dppo.runtime.models import save_model

    return save_model(make_tiny_model(seed=0, **VLLM_TINY), tokenizer, tmp_path_factory.mktemp("server-tiny"))


def group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid` (zombies excluded: they hold nothing)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def wait_gone(pgid: int, timeout_s: float = GONE_WITHIN_S) -> list[str]:
    """The names of the group's processes still alive after `timeout_s` ([] once all are gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group(pgid):
            return []
        time.sleep(0.2)
    alive = []
    for p in group(pgid):
        try:
            alive.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            pass
    return alive


def engine_core(pgid: int) -> psutil.Process:
    cores = [p for p in group(pgid) if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    assert cores, f"no engine core in the server's group: {[p.cmdline() for p in group(pgid)]}"
    return cores[0]


def start(model_dir, log_dir) -> ServerProcess:
    proc = ServerProcess(ServerLaunch(str(model_dir), kv_cache_gb=KV_GB), name="server-0", log_dir=log_dir)
    client = ServerClient(proc.url, name="server-0", timeout_s=120)
    try:
        proc.wait_healthy(180, client.healthy)
    finally:
        client.close()
    return proc


@pytest.mark.parametrize("victim", ["api-server", "engine-core"])
def test_a_killed_server_process_takes_its_whole_group_with_it(model_dir, tmp_path, victim):
    """SIGKILL of the server's API process alone, or of its engine core alone, while its owner (this process) lives
    on and calls nothing: every process of the server is gone within seconds (before the fix, the engine core, its
    worker and the resource tracker were re-parented to PID 1 and kept ~3 GB)."""
    proc = start(model_dir, tmp_path)
    try:
        members = group(proc.pid)
        assert len(members) >= 3, [p.cmdline() for p in members]  # API server, engine core, worker (+ tracker)
        os.kill(proc.pid if victim == "api-server" else engine_core(proc.pid).pid, signal.SIGKILL)
        assert wait_gone(proc.pid) == [], f"outlived the {victim}'s SIGKILL"
    finally:
        proc.stop()


def test_stop_kills_what_is_left_of_a_server_whose_api_process_died(model_dir, tmp_path):
    """`ServerProcess.stop` after the API process has exited still kills the rest of its group (it used to return
    as soon as the process it started had exited)."""
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
def test_no_server_outlives_its_owner(model_dir, tmp_path, death):
    """The process that started the server dies — by SIGKILL, or by an exception that never closes the engine:
    the server's whole group is gone within seconds."""
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
