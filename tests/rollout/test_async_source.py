"""Asynchronous rollouts (`rollout.mode async`): workers in their own processes, bounded staleness, the recorded µ of
every response equal to the distribution of the weight version it names, lifecycle and faults, and a Ray cluster
of two nodes simulated on this machine.

Every run here uses the hf engine in float32 and one thread per process, so that sync and async compute the same
numbers and a recomputed µ can be compared at float32 rounding.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dppo.rollout.remote import WorkerError
from dppo.rollout.server.launch import SERVER_ENTRY_ENV
from dppo.rollout.settings import HFSettings
from dppo.train.config import ConfigError, replace
from dppo.train.scoring import score_responses_reference
from dppo.train.trainer import Trainer
from conftest import VLLM_MARKS, smoke_config
from server_processes import FAKE_SERVER

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, *, mode="async", steps=4, **rollout):
    extra = {"max_staleness": 1, "worker_threads": 1, "worker_timeout_s": 60.0} if mode == "async" else {}
    return smoke_config(tmp_path, rollout={"engine": "hf", "dtype": "float32", "mode": mode, **extra, **rollout},
                        train={"threads": 1, "steps": steps})


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class _Recording(Trainer):
    """Keeps every published weight version and every trained batch."""

    def __init__(self, *args, **kwargs) -> None:
        self.versions: dict[int, dict] = {}
        self.batches: list[tuple[int, object]] = []
        super().__init__(*args, **kwargs)

    def _engine_state(self):
        state = super()._engine_state()
        version = self.step_idx + (1 if hasattr(self, "source") else 0)  # at start (no source yet): step_idx
        self.versions[version] = {k: v.detach().clone() for k, v in state.items()}
        return state

    def _update(self, batch, adv, old, timer=None):
        self.batches.append((self.step_idx, batch))
        return super()._update(batch, adv, old, timer)


def test_async_with_staleness_0_equals_sync(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        trainer = Trainer(_cfg(tmp_path / mode, mode=mode, **({"max_staleness": 0} if mode == "async" else {})),
                          tmp_path / mode)
        try:
            metrics = [trainer.step() for _ in range(3)]
            runs[mode] = (_weights(trainer.model), metrics)
        finally:
            trainer.close()
    assert torch.equal(runs["sync"][0], runs["async"][0])
    for sync, async_ in zip(runs["sync"][1], runs["async"][1]):
        for key in ("reward/mean", "loss/policy", "mismatch/binary_tv_mean", "optim/grad_norm", "response/length_mean"):
            assert sync[key] == async_[key], key
        assert async_["rollout/staleness_max"] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_response_is_staler_than_k_and_mu_is_its_versions_distribution(tmp_path, k):
    trainer = _Recording(_cfg(tmp_path, max_staleness=k, steps=5), tmp_path)
    try:
        metrics = [trainer.step() for _ in range(5)]
        # the version each response names, recomputed in fp32 from that version's weights: the recorded µ
        model, temperature = trainer.model, trainer.cfg.rollout.temperature
        live = {n: p.detach().clone() for n, p in model.state_dict().items()}
        seen = set()
        for step, batch in trainer.batches:
            staleness = step - batch.weight_version
            assert int(staleness.min()) >= 0 and int(staleness.max()) <= k
            assert torch.equal(batch.staleness.cpu(), staleness)
            for version in batch.weight_version.unique().tolist():
                seen.add(step - version)
                rows = (batch.weight_version == version).nonzero().squeeze(1)
                model.load_state_dict(trainer.versions[version])
                with torch.no_grad():
                    ref = score_responses_reference(model, [batch.prompt_ids[i] for i in rows.tolist()],
                                                    batch.response_ids[rows], batch.response_mask[rows],
                                                    temperature=temperature)
                mask = batch.response_mask[rows]
                assert torch.allclose(ref.logp[mask], batch.rollout_logp[rows][mask], rtol=0, atol=2e-5)
        model.load_state_dict(live)
    finally:
        trainer.close()
    assert seen == set(range(k + 1))  # every staleness 0..k occurred: the workers really sampled ahead
    for m in metrics:
        assert m["rollout/staleness_max"] <= k
        for j in range(k + 1):  # a staleness held by every response: its mismatch and masking are the batch's
            if m[f"rollout/staleness_frac_{j}"] == 1.0:
                assert m[f"mismatch/binary_tv_stale_{j}"] == pytest.approx(m["mismatch/binary_tv_mean"], rel=1e-5)
                assert m[f"trust_region/masked_frac_stale_{j}"] == pytest.approx(m["trust_region/masked_frac"], abs=1e-7)
    # a step whose whole batch is k stale: the workers ran the full k ahead (not necessarily the last step: on a loaded
    # machine a slow worker can fall back, as seen in the full suite beside the vLLM server fault tests)
    assert any(m["rollout/staleness_mean"] == k for m in metrics) and metrics[-1]["mismatch/binary_tv_mean"] > 0
    assert all(0 <= m["async/trainer_idle_frac"] <= 1 and 0 <= m["async/worker_idle_frac"] <= 1 for m in metrics)


def test_two_workers_share_the_batch_and_sample_differently(tmp_path):
    trainer = _Recording(_cfg(tmp_path, devices="cpu,cpu", steps=2), tmp_path)
    try:
        assert len(set(trainer.source.pool.pids)) == 2
        trainer.step()
        _, batch = trainer.batches[0]
        P, G = trainer.cfg.rollout.prompts_per_step, trainer.cfg.rollout.group_size
        assert batch.prompt_index.tolist() == [i // G for i in range(P * G)]
        # one prompt to each worker, same call seed: the second share gets its own seed, so the same prompt is
        # answered differently (with one seed the hf engine would give both the same uniform stream)
        example = trainer._draw(0).examples[0]
        params = trainer._sampling_params(0, n=1)
        a, b = trainer.source.generate([example, example], params)
        assert (a.prompt_index, b.prompt_index) == (0, 1)
        assert not torch.equal(a.response_ids, b.response_ids) or not torch.equal(a.rollout_logp, b.rollout_logp)
        assert trainer.evaluate()["n"] > 0  # evaluation goes through the workers too
    finally:
        trainer.close()


def test_checkpoint_keeps_the_trained_position_and_resume_resamples_in_flight_batches(tmp_path):
    cfg = _cfg(tmp_path, max_staleness=2, steps=2)
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.train()
        P = cfg.rollout.prompts_per_step
        assert trainer.sampler.position == 4 * P  # drawn: steps 0..3 (2 steps trained, 2 in flight)
    finally:
        trainer.close()
    resumed = Trainer(replace(cfg, train={"steps": 3}), tmp_path, resume=True)
    try:
        assert resumed.step_idx == 2 and resumed.sampler.position >= 2 * P
        assert resumed.source.trained_position == 2 * P
        resumed.step()
        assert resumed.source.trained_position == 3 * P
    finally:
        resumed.close()


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rollout, field, message", [
    ({"max_staleness": -1}, "rollout.max_staleness", "expected >= 0"),
    ({"devices": "tpu:0"}, "rollout.devices", "is not a device"),
    ({"devices": "cpu,cpu,cpu", "prompts_per_step": 2}, "rollout.devices", "3 rollout workers"),
    ({"engine_lag": -1}, "rollout.engine_lag", "expected >= 0"),
    ({"worker_timeout_s": 0}, "rollout.worker_timeout_s", "expected > 0"),
    ({"mode": "sync", "devices": "cpu"}, "rollout.devices", "needs rollout.mode async"),
])
def test_bad_async_settings_name_the_field(tmp_path, rollout, field, message):
    with pytest.raises(ConfigError, match=rf"^{field}: .*{message}"):
        _cfg(tmp_path, **rollout)


def test_missing_devices_and_engines_without_weights_fail_before_any_model_loads(tmp_path, monkeypatch):
    import dppo.train.trainer as trainer_module

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^rollout\.devices: 'cuda:3' does not exist on this machine"):
            Trainer(_cfg(tmp_path, devices="cuda:3"), tmp_path)
    monkeypatch.setattr(HFSettings, "can_receive_weights", False)  # an engine that declares it takes no weights
    with pytest.raises(ConfigError, match=r"^rollout\.engine: 'hf' cannot receive weights"):
        Trainer(_cfg(tmp_path), tmp_path)


# ---------------------------------------------------------------------------------------------- faults, lifecycle
def test_a_killed_worker_is_named_and_nothing_hangs(tmp_path):
    trainer = Trainer(_cfg(tmp_path, steps=4), tmp_path)
    try:
        trainer.step()
        pid = trainer.source.pool.pids[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rollout worker 0 \(cpu, pid {pid}\) died \(pid {pid}, exit code -9\)"):
            for _ in range(3):
                trainer.step()
        assert time.monotonic() - t0 < 10
    finally:
        trainer.close()


def test_a_hung_worker_is_reported_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPO_FAULT_INJECT", "worker_hang@3")  # the worker's request of step 3 never returns
    trainer = Trainer(_cfg(tmp_path, steps=4, max_staleness=0), tmp_path)
    trainer.source.pool.timeout_s = 3.0  # rollout.worker_timeout_s, shortened once the worker has started
    try:
        trainer.step()
        trainer.step()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"rollout worker 0 \(cpu, pid \d+\) returned nothing for 3 s"):
            trainer.step()
        assert 2.5 < time.monotonic() - t0 < 15
        pid = trainer.source.pool.pids[0]
    finally:
        trainer.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _workers_of(proc: subprocess.Popen, deadline_s: float = 90) -> list[psutil.Process]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        kids = [c for c in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        if kids:
            return kids
        time.sleep(0.1)
    raise AssertionError("no rollout worker process appeared")


def _train_cmd(run: Path) -> list[str]:
    return [sys.executable, "-m", "dppo.cli", "train", "--preset", "smoke", "--train.steps", "400", "--run-dir",
            str(run), "--log.no-progress", "--log.report-to", "none", "--train.no-eval-before", "--rollout.mode", "async",
            "--rollout.engine", "hf", "--rollout.dtype", "float32", "--train.threads", "1"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_the_trainer(tmp_path, sig):
    """SIGTERM: the trainer checkpoints, stops its workers and exits 0. SIGKILL: the kernel kills the workers."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(_train_cmd(run), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        workers = _workers_of(proc)
        deadline = time.monotonic() + 90
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, err
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stopped_early"] and (run / "checkpoints" / f"step_{summary['step']:06d}" / "COMPLETE").is_file()
    deadline = time.monotonic() + 10
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------------------------------------- Ray
@pytest.mark.slow
def test_ray_workers_on_two_nodes(tmp_path):
    """Two Ray nodes on this machine (one CPU each): one worker lands on each, the staleness bound holds, and the
    recorded µ is each version's distribution."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        # Ray starts its workers' processes slowly on a busy 2-core machine (not started after 60 s with two study
        # processes beside it): 180 s to start, still far below the default 600 s
        cfg = _cfg(tmp_path, backend="ray", ray_address=cluster.address, devices="cpu,cpu", steps=3,
                   worker_timeout_s=180.0)
        trainer = _Recording(cfg, tmp_path)
        try:
            nodes = {info["node"] for info in trainer.source.pool.info}
            assert len(nodes) == 2, trainer.source.pool.info
            metrics = [trainer.step() for _ in range(3)]
            assert max(m["rollout/staleness_max"] for m in metrics) == 1
            step, batch = trainer.batches[-1]
            version = int(batch.weight_version[0])
            rows = (batch.weight_version == version).nonzero().squeeze(1)
            live = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
            trainer.model.load_state_dict(trainer.versions[version])
            with torch.no_grad():
                ref = score_responses_reference(trainer.model, [batch.prompt_ids[i] for i in rows.tolist()],
                                                batch.response_ids[rows], batch.response_mask[rows])
            trainer.model.load_state_dict(live)
            mask = batch.response_mask[rows]
            assert torch.allclose(ref.logp[mask], batch.rollout_logp[rows][mask], rtol=0, atol=2e-5)
        finally:
            trainer.close()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


# ---------------------------------------------------------------------------------------------- in-flight updates
def test_an_in_flight_update_rebuilds_the_cache_and_each_token_names_its_weights(make_tiny_model, tokenizer, chat_prompts):
    """The engine loads new weights after the first decode chunk (8 tokens): the tokens before are sampled from the
    old weights' distribution, the ones after from the new weights' (the KV cache recomputed), each token's
    version is recorded, and µ at every position is the distribution of the weights that sampled it."""
    from dppo.rollout import SamplingParams
    from dppo.rollout.hf import HFEngine
    from dppo.train.batch import collate

    old, new = make_tiny_model(seed=0), make_tiny_model(seed=1)
    engine = HFEngine(old, tokenizer, dtype=torch.float32, seed=0)
    calls = []

    def poll():
        calls.append(len(calls))
        if len(calls) == 1:
            engine.load_weights(new)
            return True
        return False

    engine.between_chunks = poll
    params = SamplingParams(n=2, max_new_tokens=20, seed=3)
    rollouts = engine.generate(chat_prompts, params)
    batch = collate(rollouts, pad_id=engine.pad_id)
    versions = batch.token_version
    long = batch.response_lengths > 8
    assert calls and bool(long.any())
    assert (versions[:, :8][batch.response_mask[:, :8]] == 0).all()
    assert (versions[:, 8:][batch.response_mask[:, 8:]] == 1).all() and bool((versions == 1).any())
    assert (batch.weight_version == 0).all()
    for model, version in ((old, 0), (new, 1)):
        with torch.no_grad():
            ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask)
        at = batch.response_mask & (versions == version)
        assert torch.allclose(ref.logp[at], batch.rollout_logp[at], rtol=0, atol=2e-5)
        other = batch.response_mask & (versions != version)
        assert (ref.logp[other] - batch.rollout_logp[other]).abs().max() > 1e-3  # the two models really differ


def test_a_local_worker_loads_a_version_published_mid_response(tmp_path):
    """The local worker's in-flight path, deterministically: version 1 is published after the worker loaded version 0,
    so the worker's poll loads it at the first decode chunk; tokens 0-7 name version 0, later ones version 1, and µ
    at every position is that version's distribution."""
    import multiprocessing

    from dppo.rollout.remote.local import _load_latest
    from dppo.rollout.remote.worker import Request, WorkerCore
    from dppo.train.batch import collate
    from dppo.train.build import build_model
    from dppo.train.rollout_build import engine_spec

    cfg = _cfg(tmp_path, in_flight_updates=True, max_new_tokens=20)
    core = WorkerCore(engine_spec(cfg, device="cpu"), 0, 1)
    v0 = {k: v.detach().clone() for k, v in core.engine.model.state_dict().items()}
    v1 = {k: v + 0.05 * torch.randn_like(v) for k, v in v0.items()}
    shared = {k: v.clone() for k, v in v0.items()}
    version, lock = multiprocessing.Value("q", 0), multiprocessing.Lock()
    _load_latest(core, shared, version, lock)
    core.enable_in_flight(lambda: _load_latest(core, shared, version, lock) > 0)
    for k in shared:  # the trainer publishes version 1 while the worker is between requests
        shared[k].copy_(v1[k])
    version.value = 1
    trainer = Trainer(_cfg(tmp_path / "t", mode="sync"), tmp_path / "t")  # for its prompts and sampling params
    try:
        examples, params, episodes = trainer._draw(0).examples, trainer._sampling_params(0), trainer.episodes
    finally:
        trainer.close()
    result = core.run(Request(1, 0, examples, dataclasses.replace(params, max_new_tokens=20), episodes))
    assert result.error is None and result.version == 0 and result.load_s > 0
    batch = collate(result.rollouts, pad_id=core.engine.pad_id)
    versions, mask = batch.token_version, batch.response_mask
    assert bool((batch.response_lengths > 8).any())
    assert (versions[:, :8][mask[:, :8]] == 0).all() and (versions[:, 8:][mask[:, 8:]] == 1).all()
    model = build_model(cfg, None)[0].eval()
    for weights, v in ((v0, 0), (v1, 1)):
        model.load_state_dict(weights)
        with torch.no_grad():
            ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, mask)
        at = mask & (versions == v)
        assert bool(at.any()) and torch.allclose(ref.logp[at], batch.rollout_logp[at], rtol=0, atol=2e-5)
    core.close()


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm-server", marks=[*VLLM_MARKS, pytest.mark.slow])])
def test_trainer_with_in_flight_updates_records_every_tokens_version(tmp_path, monkeypatch, engine):
    """In the trainer, whatever versions arrived mid-response (it depends on timing: with 48-token responses and one
    mini-batch about a third of the tokens after step 1 when the machine is quiet), each token's µ is that of the
    version it names and no response started staler than k. vllm-server: the worker's server takes each version
    through the weight-update API mid-request (pause keep) and stamps every token with its version, and the
    worker's server counters reach the step's metrics. The server is the fake one (`fake_vllm_server.py`: dppo's
    async worker and server engine are what is tested here); real vLLM's pause-keep stamping is
    test_server_engine.py's `test_a_response_that_spans_an_update_records_each_tokens_version`."""
    monkeypatch.setenv(SERVER_ENTRY_ENV, FAKE_SERVER)  # (inherited by the rollout worker's process)
    cfg = replace(_cfg(tmp_path, max_staleness=1, steps=4, in_flight_updates=True, max_new_tokens=48, engine=engine,
                       worker_timeout_s=300.0),  # a server's start included
                  train={"mini_batches": 1})
    trainer = _Recording(cfg, tmp_path)
    try:
        steps = [trainer.step() for _ in range(4)]
        if engine == "vllm-server":  # the worker's engine counters, through its results
            assert steps[-1]["server/up"] == 1.0 and steps[-1]["server/failures"] == 0.0
        else:
            assert not any(k.startswith("server/") for k in steps[-1])
        model, live = trainer.model, {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
        for step, batch in trainer.batches:
            versions = batch.token_version
            assert int((step - batch.weight_version).max()) <= 1
            assert (versions[batch.response_mask] >= batch.weight_version[:, None].expand_as(versions)[batch.response_mask]).all()
            for version in versions[batch.response_mask].unique().tolist():
                model.load_state_dict(trainer.versions[version])
                with torch.no_grad():
                    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask)
                at = batch.response_mask & (versions == version)
                assert torch.allclose(ref.logp[at], batch.rollout_logp[at], rtol=0, atol=2e-5)
        model.load_state_dict(live)
    finally:
        trainer.close()


def test_in_flight_updates_need_the_local_hf_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.in_flight_updates: needs rollout\.backend local"):
        _cfg(tmp_path, in_flight_updates=True, backend="ray")
    with pytest.raises(ConfigError, match=r"^rollout\.in_flight_updates: needs rollout\.mode async"):
        _cfg(tmp_path, mode="sync", in_flight_updates=True)
    with pytest.raises(ConfigError, match=r"^rollout\.in_flight_updates: the vllm engine cannot update in flight "
                                          r"\(hf, vllm-server can\)"):
        _cfg(tmp_path, engine="vllm", in_flight_updates=True)
