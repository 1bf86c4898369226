"""A run goes on when a vLLM server dies (`dppo.rollout.server.members`), on a tiny seeded random model: a server
killed mid-call is restarted with the current weights and the call completes; an attached server that dies is
left out until it answers again; the trainer, with one server or two, finishes every step after a SIGKILL mid-step.
(With rollout.vllm_server.restarts 0 the step fails naming the server: test_server_engine.py.)

This is dppo's logic: the tests run on the fake server (`fake_vllm_server.py`, the routes dppo uses over the tiny
model in fp32, healthy in seconds); one restart runs on real vLLM too (a start costs ~25-30 s on 2 cores: slow),
between SIGKILLs of its API process and of the restarted server's engine core, each checked, with nobody calling
`stop`, to leave nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time

import pytest
from server_processes import (KV_GB, VLLM_TINY, engine_core, fake_vllm, group, model_dir, picked,  # noqa: F401
                              real_vllm, start, wait_gone)

from dppo.rollout import SamplingParams, make_engine
from dppo.rollout.server.launch import ServerLaunch
from dppo.rollout.settings import VLLMServerSettings

pytestmark = pytest.mark.slow  # (each test starts servers and waits for restarts: seconds on the fake)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]


def kill_when_busy(member, *, timeout_s: float = 120.0) -> threading.Thread:
    """A thread that SIGKILLs `member`'s API server (alone: its watchdogs take the rest) as soon as a generate
    request is out on it: a server dying mid-step, its requests in flight."""

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while member.client.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(member.process.pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def events(log_dir) -> list[dict]:
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_server_killed_mid_call_is_restarted_with_the_current_weights_and_the_call_completes(
        fake_vllm, model_dir, tokenizer, make_tiny_model, tmp_path):
    """One server, weights synced once, SIGKILLed while a generate call is out: the call returns every response, the
    server is restarted on a new port and given the synced weights before it takes requests (µ equals those
    weights' forward, not the model folder's), nothing of the old server is left, and each event is counted and
    written to events.jsonl. On the fake server (real vLLM: the test below)."""
    _killed_then_restarted(model_dir, tokenizer, make_tiny_model, tmp_path, mid_call=True)


@real_vllm
def test_a_killed_vllm_server_leaves_nothing_and_is_restarted_with_the_current_weights(
        model_dir, tokenizer, make_tiny_model, tmp_path):
    """Real vLLM (two server starts: the suite's only real-vLLM fault test). SIGKILL of the server's API process
    alone, while no call is out — so nobody calls `ServerProcess.stop` (the engine notices a dead server only when
    it calls it): every process of the server's group (engine core, its worker, the resource tracker) is gone
    within seconds, by the watchdogs alone (they used to be re-parented to PID 1 and keep ~3 GB). The next call
    then finds the server dead, restarts it on a new port with the synced weights and completes, as in the
    fake-server test above. Last, SIGKILL of the restarted server's engine core alone: again nothing of it is left.
    (The death of the process that started a server: test_server_faults.py, on the fake server.)"""
    _killed_then_restarted(model_dir, tokenizer, make_tiny_model, tmp_path, mid_call=False)


def _killed_then_restarted(model_dir, tokenizer, make_tiny_model, tmp_path, *, mid_call: bool) -> None:
    from dppo.train.weights import engine_state

    trained = make_tiny_model(seed=7, **VLLM_TINY)
    with make_engine("vllm-server", model_dir, tokenizer, VLLMServerSettings(kv_cache_gb=KV_GB, timeout_s=180),
                     log_dir=tmp_path) as eng:
        eng.load_weights(engine_state(trained))
        member = eng.group.members[0]
        old_pid, old_url = member.process.pid, member.client.url
        if mid_call:
            kill_when_busy(member)
        else:
            assert len(group(old_pid)) >= 3, [p.cmdline() for p in group(old_pid)]  # API server, core, worker
            os.kill(old_pid, signal.SIGKILL)
            assert wait_gone(old_pid) == [], "outlived the API server's SIGKILL"
            assert member.process.pid == old_pid and eng.metrics()["server/failures"] == 0  # (nobody noticed)
        rollouts = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=48))
        assert len(rollouts) == 6 and [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
        assert member.process.pid != old_pid and member.client.url != old_url
        assert wait_gone(old_pid) == []
        for r in rollouts:
            assert bool((r.token_versions == 1).all())
            assert (picked(trained, r) - r.rollout_logp).abs().max() <= 1e-4
        counts = eng.metrics()
        assert counts["server/failures"] == 1 and counts["server/restarts"] == 1 and counts["server/rejoins"] == 1
        assert counts["server/retried_requests"] >= 1 and counts["server/up"] == 1
        assert [e["event"] for e in events(tmp_path)] == ["failed", "restarting", "rejoined"]
        # the restarted server's engine core SIGKILLed, again with nobody calling: nothing of that server is left
        new_pid = member.process.pid
        os.kill(engine_core(new_pid).pid, signal.SIGKILL)
        assert wait_gone(new_pid) == [], "outlived the engine core's SIGKILL"


def test_an_attached_server_that_dies_is_left_out_until_it_answers_again(fake_vllm, model_dir, tokenizer,
                                                                          make_tiny_model, tmp_path):
    """Two attached servers; one is stopped: calls go to the other, and it is asked for /health until a server
    answers at its URL again, which then rejoins with the synced weights."""
    from dppo.train.weights import engine_state

    trained = make_tiny_model(seed=7, **VLLM_TINY)
    first, second = start(model_dir, tmp_path / "a"), start(model_dir, tmp_path / "b")
    again = None
    try:
        settings = VLLMServerSettings(kv_cache_gb=KV_GB, urls=f"{first.url},{second.url}", timeout_s=180)
        with make_engine("vllm-server", model_dir, tokenizer, settings, log_dir=tmp_path) as eng:
            eng.load_weights(engine_state(trained))
            first.stop()
            rollouts = eng.generate(PROMPTS * 2, SamplingParams(n=2, max_new_tokens=8))
            assert len(rollouts) == 12 and eng.metrics()["server/up"] == 1
            assert eng.metrics()["server/restarts"] == 0  # (dppo does not start servers it did not start)
            launch = ServerLaunch(str(model_dir), kv_cache_gb=KV_GB)  # the user starts it again, on its port
            with open(tmp_path / "again.log", "wb") as log:  # (SO_REUSEADDR: the port's TIME_WAIT is no obstacle)
                again = subprocess.Popen(launch.command(first.port), env=launch.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 180
            while eng.metrics()["server/up"] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert eng.metrics()["server/up"] == 2 and eng.metrics()["server/rejoins"] == 1
            back = eng.group.members[0].client
            for _ in range(3):  # the least loaded first: the rejoined server takes calls, with the synced weights
                (r,) = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8))
                assert (picked(trained, r) - r.rollout_logp).abs().max() <= 1e-4
            assert back.outstanding == 0
    finally:
        first.stop()
        second.stop()
        if again is not None:
            os.killpg(again.pid, signal.SIGKILL)
            again.wait()


def _trainer_run(tmp_path, servers: int) -> tuple[int, list[dict]]:
    """Four steps of the smoke run on `servers` servers, server-0 SIGKILLed during step 2's generation, step 4 once
    every server is up again: the killed pid and each step's metrics."""
    from conftest import smoke_config

    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32", "max_new_tokens": 24,
                                          "vllm_server": {"kv_cache_gb": KV_GB, "timeout_s": 180.0,
                                                          "servers": servers}},
                       train={"steps": 4, "threads": 1})
    trainer = Trainer(cfg, tmp_path)
    steps, killed = [], None
    try:
        while trainer.step_idx < 4:
            if trainer.step_idx == 1:
                victim = trainer.engine.group.members[0]
                killed, killer = victim.process.pid, kill_when_busy(victim)
            if trainer.step_idx == 3:  # (two servers: the run went on without server-0; wait for it to rejoin)
                deadline = time.monotonic() + 180
                while len(trainer.engine.group.up()) < servers and time.monotonic() < deadline:
                    time.sleep(0.5)
            steps.append(trainer.step())
            if trainer.step_idx == 2:
                killer.join(5)
                assert not killer.is_alive(), "server-0 took no request during step 2"
    finally:
        trainer.close()
    return killed, steps


@pytest.mark.parametrize("servers", [1, 2])
def test_a_run_whose_server_is_killed_mid_step_finishes_every_step(fake_vllm, tmp_path, servers):
    """The trainer, one server (restarted: the step waits for it) or two (the other takes the requests while it
    restarts): SIGKILL of server-0 during step 2's generation; every step finishes without --resume, with finite
    metrics; the failure, restart and rejoin are counted in the steps' metrics and written to events.jsonl, and
    the restarted server serves step 4 with the weights of step 3."""
    killed, steps = _trainer_run(tmp_path, servers)
    assert len(steps) == 4 and wait_gone(killed) == []
    assert all(math.isfinite(float(v)) for m in steps for v in m.values() if isinstance(v, (int, float)))
    assert steps[0]["server/failures"] == 0 and steps[1]["server/failures"] == 1
    assert steps[1]["server/retried_requests"] >= 1 and steps[3]["server/restarts"] == 1
    assert steps[3]["server/rejoins"] == 1 and steps[3]["server/up"] == servers
    assert [e["event"] for e in events(tmp_path / "servers")] == ["failed", "restarting", "rejoined"]
