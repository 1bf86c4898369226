"""What the vLLM server fault tests share (`test_server_faults.py`, `test_server_recovery.py`,
`test_server_engine.py`): the tiny model's folder, a server started directly, the processes of a server's group
(zombies excluded), and the fake server (`fake_vllm`: dppo starts `fake_vllm_server.py` instead of vLLM, for the
tests of dppo's own logic; `real_vllm`: marks a test that runs on real vLLM)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import VLLM_MARKS

from dppo.rollout.server.client import ServerClient
from dppo.rollout.server.launch import SERVER_ENTRY_ENV, ServerLaunch, ServerProcess

VLLM_TINY = dict(num_heads=2, num_kv_heads=1)
KV_GB = 0.25
GONE_WITHIN_S = 15.0
FAKE_SERVER = str(Path(__file__).with_name("fake_vllm_server.py"))


def real_vllm(test):
    """Marks a test that runs on real vLLM (each start ~30 s on 2 cores): VLLM_MARKS and slow."""
    for mark in (*VLLM_MARKS, pytest.mark.slow):
        test = mark(test)
    return test


@pytest.fixture
def fake_vllm(monkeypatch):
    """dppo starts the fake vLLM server (`fake_vllm_server.py`, healthy in seconds) instead of vLLM's: the servers
    started in the test, restarts included, and those of the processes it starts (the environment is inherited)."""
    monkeypatch.setenv(SERVER_ENTRY_ENV, FAKE_SERVER)


@pytest.fixture(scope="module")
def model_dir(make_tiny_model, tokenizer, tmp_path_factory):
    from dppo.runtime.models import save_model

    return save_model(make_tiny_model(seed=0, **VLLM_TINY), tokenizer, tmp_path_factory.mktemp("server-tiny"))


def picked(model, r) -> torch.Tensor:
    """log π(a_t) of the sampled tokens under `model` (one plain fp32 forward of prompt + response)."""
    ids = torch.cat([r.prompt_ids, r.response_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, r.prompt_ids.numel() - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, r.response_ids[:, None])[:, 0]


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
