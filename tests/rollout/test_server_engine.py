"""The `vllm-server` engine (vLLM's own server, started by dppo) on a tiny seeded random model: µ and µ's top-K
against a plain fp32 forward, weight sync through vLLM's RL API and dppo's shared-memory transfer, partial rollouts
(each token stamped with its version; re-scoring reproduces µ), attaching to a running server, load balancing, and
the faults: refused before start (no model, port in use), a failed start naming its cause and log, a server that
dies mid-step and a model that differs from the trainer's (the kill cases: test_server_faults.py).

One server serves the module (a start costs ~25-40 s on 2 cores), started with LoRA enabled; tests that change its
weights put them back. The adapter-only sync runs on real vLLM (its LoRA loading is what it checks) as an engine
attached to that server, so it pays no start of its own (a LoRA-enabled server syncs full weights as well: the tests
before it check µ at 1e-4 on it). The tests of dppo's own logic that need servers of their own (a failed start, the
trainer stopping at a dead server) run on the fake server (`fake_vllm_server.py`, healthy in seconds).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import VLLM_MARKS
from server_processes import fake_vllm  # noqa: F401 (a fixture)

from dppo.rollout import Engine, SamplingParams, make_engine
from dppo.rollout.settings import Adapter, VLLMServerSettings
from dppo.rollout.base import Rollout
from dppo.rollout.server.launch import ServerError, failure_cause

pytestmark = VLLM_MARKS  # the module's server tests are fast enough for scripts/gpu-check.sh; each extra start: slow

VLLM_TINY = dict(num_heads=2, num_kv_heads=1)
"""Head size 32, the smallest vLLM's CPU attention supports (as in test_rollout_vllm)."""
KV_GB = 0.25
LORA_ARGS = "--enable-lora --max-loras 2 --max-cpu-loras 4 --max-lora-rank 8"
"""The module's server starts with LoRA enabled (as an adapter-sync engine starts its own), so that the adapter-only
sync test attaches to it instead of paying a server start of its own; every other test syncs full weights."""
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def server_model(make_tiny_model):
    return make_tiny_model(seed=0, **VLLM_TINY)


@pytest.fixture(scope="module")
def model_dir(server_model, tokenizer, tmp_path_factory):
    from dppo.runtime.models import save_model

    return save_model(server_model, tokenizer, tmp_path_factory.mktemp("server-tiny"))


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer, tmp_path_factory):
    eng = make_engine("vllm-server", model_dir, tokenizer, VLLMServerSettings(kv_cache_gb=KV_GB, args=LORA_ARGS), seed=0,
                      log_dir=tmp_path_factory.mktemp("server-logs"))
    yield eng
    eng.close()


def scores(model, r: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """[T, V] log-probs of one plain fp32 forward of prompt + response (no cache)."""
    ids = torch.cat([r.prompt_ids, r.response_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, r.prompt_ids.numel() - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1)


def worst(diff: torch.Tensor) -> float:
    return float(diff.abs().max()) if diff.numel() else 0.0


def picked(model, r: Rollout, temperature: float = 1.0) -> torch.Tensor:
    return scores(model, r, temperature).gather(-1, r.response_ids[:, None])[:, 0]


# --- sampling -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mu_and_topk_equal_an_fp32_forward(engine, server_model, temperature):
    K = 8
    rollouts = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_new_tokens=16,
                                                       top_k_logprobs=K))
    assert isinstance(engine, Engine) and len(rollouts) == 9
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # prompt-major
    for r in rollouts:
        assert r.prompt_ids.tolist() == PROMPTS[r.prompt_index]
        logp = scores(server_model, r, temperature)
        assert (logp.gather(-1, r.response_ids[:, None])[:, 0] - r.rollout_logp).abs().max() <= 1e-4
        assert r.rollout_topk_ids.shape == (r.response_ids.numel(), K + 1)
        top = logp.topk(K, -1)
        assert torch.equal(r.rollout_topk_ids[:, :K], top.indices)  # µ's top-K in rank order
        assert (r.rollout_topk_logp[:, :K] - top.values).abs().max() <= 1e-4
        in_top = (top.indices == r.response_ids[:, None]).any(-1)
        assert torch.equal(r.rollout_topk_valid[:, K], ~in_top)  # the sampled token's own slot when outside
        assert torch.equal(r.rollout_topk_ids[~in_top, K], r.response_ids[~in_top])
        assert r.finish_reason in ("eos", "length")
        assert (r.finish_reason == "eos") == (int(r.response_ids[-1]) in engine.eos_ids)


def test_an_agent_through_the_proxy_on_the_server_engine_records_mu_and_its_topk(engine, server_model):
    """dppo's agent proxy in front of the server engine: a three-call episode's generated tokens carry µ and µ's
    top-K of an fp32 forward, the tool answers in between are inserted (mask 0)."""
    from pathlib import Path

    from dppo.episodes.settings import AgentSettings, ProxySettings
    from dppo.example import Example
    from dppo.train.batch import collate
    from dppo.train.scoring import score_responses_reference

    agent = f"{Path(__file__).resolve().parents[1] / 'data' / 'agents.py'}:scripted"
    collector = AgentSettings(name=agent).episodes(max_new_tokens=6, proxy=ProxySettings(max_tokens=200)).collector()
    try:
        rows = collector(engine, [Example(prompt=({"role": "user", "content": "2+3?"},), answer="5")],
                         SamplingParams(n=2, max_new_tokens=6, top_k_logprobs=4, stop_token_ids=(1,), seed=3))
    finally:
        collector.close()
    batch = collate(rows, pad_id=0)
    ref = score_responses_reference(server_model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                    topk_ids=batch.rollout_topk_ids)
    gen = batch.loss_mask
    assert all(r.episode.turns == 3 and r.episode.error is None for r in rows) and (~gen & batch.response_mask).any()
    assert torch.allclose(ref.logp[gen], batch.rollout_logp[gen], rtol=0, atol=1e-4)
    valid = batch.rollout_topk_valid & gen[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=1e-4)


def test_truncated_sampling_reaches_the_server_and_mu_is_the_kept_sets_distribution(engine, server_model):
    """min_p, top_k and top_p go through the server's API: each sampled token lies in the kept set recomputed from
    an fp32 forward (test_hf.py's slow reference) and rollout_logp is log µ_S(a)."""
    from test_hf import _kept_set_reference

    for r in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, temperature=0.8, top_k=12, top_p=0.9,
                                                     min_p=0.02)):
        scaled = scores(server_model, r, 0.8)
        for t, a in enumerate(r.response_ids.tolist()):
            kept = _kept_set_reference(scaled[t], 12, 0.9, 0.02)
            assert bool(kept[a]) and kept.sum() < scaled.shape[-1]
            assert abs(float(scaled[t, a] - torch.logsumexp(scaled[t][kept], -1) - r.rollout_logp[t])) <= 1e-4


def test_stop_tokens_and_validation(engine):
    (r,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=40, stop_token_ids=tuple(range(100))))
    assert r.finish_reason in ("stop", "eos") and r.response_ids.numel() == 1  # every token stops it
    with pytest.raises(ValueError, match="top_k_logprobs"):
        engine.generate(PROMPTS, SamplingParams(top_k_logprobs=engine.max_logprobs + 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[5] * 10], SamplingParams(max_new_tokens=engine.max_context))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[10**6]], SamplingParams())


# --- weights ------------------------------------------------------------------------------------------------------


def test_weights_sync_through_the_servers_api(engine, server_model, make_tiny_model):
    new = make_tiny_model(seed=1, **VLLM_TINY)
    version = engine.weight_version
    try:
        engine.load_weights({"module." + k: v for k, v in new.state_dict().items()})
        assert engine.weight_version == version + 1
        rollouts = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12))
        for r in rollouts:
            assert r.weight_version == version + 1 and bool((r.token_versions == version + 1).all())
            assert (picked(new, r) - r.rollout_logp).abs().max() <= 1e-4
            assert (picked(server_model, r) - r.rollout_logp).abs().max() > 1e-2
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights({"model.norm.weight": torch.ones(3)})
        with pytest.raises(ValueError, match="unknown parameter"):
            engine.load_weights({"nope": torch.ones(3)})
    finally:
        engine.load_weights(server_model)
    (r,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8))
    assert (picked(server_model, r) - r.rollout_logp).abs().max() <= 1e-4
    assert list(engine._weights_dir.iterdir()) == [engine._weights_dir / f"weights-{engine._label}.safetensors"]


@pytest.mark.parametrize("partial", ["abort", "keep"])
def test_a_response_that_spans_an_update_records_each_tokens_version(engine, server_model, make_tiny_model, partial):
    """In-flight update at the 4th poll: responses straddle versions v and v+1 and every token's µ is its own
    version's forward (`abort` re-prefills the aborted requests; under `keep` vLLM 0.32 preempts the frozen
    requests and recomputes their KV on resume)."""
    new = make_tiny_model(seed=1, **VLLM_TINY)
    # The update comes at the 4th poll (~0.2 s in: some tokens sampled, most responses unfinished); on a loaded
    # machine the server may not have sampled a token by then, so a call where no response spans the update is
    # tried again with the update at other polls (the records of the call where one does are checked).
    for update_at in (4, 8, 16, 32, 2, 3, 6, 12, 24, 5):
        version, polls, resubmitted = engine.weight_version, [], engine.stats["resubmitted"]

        def between_chunks() -> bool:
            polls.append(1)
            if len(polls) == update_at:
                engine.load_weights(new)
                return True
            return False

        engine.partial, engine.between_chunks = partial, between_chunks
        try:
            rollouts = engine.generate(PROMPTS, SamplingParams(n=8, temperature=0.6, max_new_tokens=600))
        finally:
            engine.between_chunks, engine.partial = None, "keep"
            engine.load_weights(server_model)
        straddling = [r for r in rollouts if set(r.token_versions.tolist()) == {version, version + 1}]
        if straddling:
            break
    assert straddling, "no response spanned the update"
    for r in rollouts:
        v = r.token_versions
        assert bool((v[1:] >= v[:-1]).all()) and r.weight_version == int(v[0])
        old, fresh = picked(server_model, r, 0.6), picked(new, r, 0.6)
        assert worst((old - r.rollout_logp)[v == version]) <= 1e-4
        assert worst((fresh - r.rollout_logp)[v == version + 1]) <= 1e-4
    assert (engine.stats["resubmitted"] - resubmitted >= len(straddling)) == (partial == "abort")


@pytest.mark.slow
def test_attach_to_a_running_server_and_balance_two_clients(engine, model_dir, tokenizer, server_model):
    url = engine.clients[0].url
    with make_engine("vllm-server", model_dir, tokenizer, VLLMServerSettings(urls=f"{url},{url}")) as attached:
        assert attached.processes == []
        rollouts = attached.generate(PROMPTS * 4, SamplingParams(n=2, max_new_tokens=8, top_k_logprobs=2))
        assert len(rollouts) == 24
        assert [c.outstanding for c in attached.clients] == [0, 0]
        for r in rollouts[:4]:
            assert (picked(server_model, r) - r.rollout_logp).abs().max() <= 1e-4
    assert engine.clients[0].healthy()  # an attached server is left running


@pytest.mark.slow
def test_a_server_serving_another_model_is_refused(engine, make_tiny_model, tokenizer, tmp_path):
    from dppo.runtime.models import save_model

    other = save_model(make_tiny_model(seed=0, num_heads=2, num_kv_heads=1, num_layers=3), tokenizer, tmp_path)
    with pytest.raises(ServerError, match="num_hidden_layers: trainer 3, server 2"):
        make_engine("vllm-server", other, tokenizer, VLLMServerSettings(urls=engine.clients[0].url))


# --- LoRA: adapter-only sync --------------------------------------------------------------------------------------


def _peft(make_tiny_model, seed: int):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_tiny_model(seed=0, **VLLM_TINY), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                             target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


@pytest.mark.slow
def test_adapter_only_sync_serves_each_version_without_a_merge(engine, model_dir, tokenizer, make_tiny_model, tmp_path):
    """rollout.lora_sync adapter: each version is a LoRA adapter on the servers (no merged weights move); µ equals
    the PEFT model's forward; a request in flight finishes under the adapter it started with, stamped with its
    version, while new requests use the new one; an adapter no request uses is unloaded."""
    from dppo.train.weights import engine_state

    first, second = _peft(make_tiny_model, 1), _peft(make_tiny_model, 2)
    url = engine.group.members[0].client.url  # (the module's server, serving the base weights)
    settings = VLLMServerSettings(kv_cache_gb=KV_GB, lora_sync="adapter", urls=url)
    adapter = Adapter(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    with make_engine("vllm-server", model_dir, tokenizer, settings, log_dir=tmp_path, adapter=adapter) as eng:
        state = engine_state(first, adapter=True)
        assert state and all("lora_" in k for k in state)
        eng.load_weights(state)
        assert eng.weight_version == 1 and eng._adapter == "dppo-v1"
        for r in eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12)):
            assert (picked(first, r) - r.rollout_logp).abs().max() <= 1e-4
            assert bool((r.token_versions == 1).all())
        polls = []

        def between_chunks() -> bool:
            polls.append(1)
            if len(polls) == 2:
                eng.load_weights(engine_state(second, adapter=True))
                return True
            return False

        eng.between_chunks = between_chunks
        rollouts = eng.generate(PROMPTS, SamplingParams(n=4, temperature=0.6, max_new_tokens=400))
        eng.between_chunks = None
        assert eng.weight_version == 2
        for r in rollouts:  # all sent before the update: adapter 1 to the end
            assert bool((r.token_versions == 1).all())
            assert (picked(first, r, 0.6) - r.rollout_logp).abs().max() <= 1e-4
        assert not (eng._weights_dir / "adapter-1").exists() and (eng._weights_dir / "adapter-2").is_dir()
        (r,) = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12))
        assert bool((r.token_versions == 2).all()) and (picked(second, r) - r.rollout_logp).abs().max() <= 1e-4


def test_an_adapter_sync_engine_starts_its_servers_with_lora_enabled(fake_vllm, model_dir, tokenizer, make_tiny_model,
                                                                    tmp_path):
    """The servers an adapter-sync engine starts itself take adapters (`--enable-lora` and its limits on their
    command line: the fake server refuses /v1/load_lora_adapter without it), and µ is the PEFT model's forward. On
    the fake server: the real vLLM's LoRA loading is the test above, on the module's server."""
    from dppo.train.weights import engine_state

    first = _peft(make_tiny_model, 1)
    settings = VLLMServerSettings(kv_cache_gb=KV_GB, lora_sync="adapter")
    adapter = Adapter(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    with make_engine("vllm-server", model_dir, tokenizer, settings, log_dir=tmp_path, adapter=adapter) as eng:
        command = eng.processes[0].proc.args
        assert "--enable-lora" in command and command[command.index("--max-lora-rank") + 1] == "8"
        eng.load_weights(engine_state(first, adapter=True))
        for r in eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12)):
            assert (picked(first, r) - r.rollout_logp).abs().max() <= 1e-4 and bool((r.token_versions == 1).all())


# --- faults -------------------------------------------------------------------------------------------------------


def test_refused_before_start(tmp_path, tokenizer, model_dir):
    with pytest.raises(ValueError, match="neither a built-in model"):
        make_engine("vllm-server", tmp_path / "missing", tokenizer)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        from dppo.rollout.server.launch import ServerLaunch, ServerProcess

        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is in use"):
            ServerProcess(ServerLaunch(str(model_dir)), name="server-0", log_dir=tmp_path, port=port)


def test_failure_causes_are_read_from_the_log():
    assert failure_cause("OSError: [Errno 98] Address already in use", 1) == "the port is in use"
    assert failure_cause("torch.OutOfMemoryError: CUDA out of memory", 1) == "out of memory"
    assert failure_cause("", -signal.SIGKILL) == "killed by SIGKILL (out of memory?)"
    assert failure_cause("ValueError: bad thing\nstack", 1) == "ValueError: bad thing"
    # a healthy start's INFO lines name the KV cache too: only error lines are read
    healthy = "INFO [utils.py:347] Using LBHNC KV cache layout.\nINFO max_model_len 512\n"
    assert failure_cause(healthy + "OSError: no file named config.json in /m", 1) == "the model could not be loaded"
    assert failure_cause(healthy + "RuntimeError: something else", 1) == "RuntimeError: something else"
    # the root cause far above the tail, the API server's own error last (as a failed KV-cache start logs it)
    log = ("ERROR [core.py] ValueError: No available memory for the cache blocks.\n" + "  frame\n" * 100
           + "RuntimeError: Engine core initialization failed. See root cause above.")
    assert failure_cause(log, 1) == "not enough memory for the KV cache"


@pytest.mark.slow
def test_a_failed_start_names_the_server_its_log_and_cause(fake_vllm, model_dir, tokenizer, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        make_engine("vllm-server", model_dir, tokenizer, VLLMServerSettings(kv_cache_gb=1e-5, timeout_s=300),
                    log_dir=tmp_path)
    message = str(e.value)
    assert "server-0" in message and f"log {tmp_path}/server-0-port" in message and "exited" in message
    assert "KV cache" in message or "memory" in message
    assert time.monotonic() - t0 < 300  # found when the process exits, not by the timeout


def test_a_server_that_dies_mid_step_fails_the_step_naming_it(engine):
    """Last in the module: kills the module's server (not restarted: restarts are test_server_faults.py's)."""
    engine.group.restarts = 0
    proc = engine.processes[0]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.proc.wait(30)
    with pytest.raises(ServerError, match=r"server-0 \(http://127\.0\.0\.1:(\d+), log .*server-0-port\1\.log\)"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))


@pytest.mark.slow
def test_the_trainer_stops_naming_a_dead_server_and_resume_continues(fake_vllm, tmp_path):
    """With restarts 0, a server killed during training: the next step fails with an error naming the server and its
    log (no hang, no wrong batch); `resume` starts a new server and continues from the last checkpoint (step,
    weights, prompts)."""
    from conftest import smoke_config

    from dppo.train.config import replace
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32",
                                          "vllm_server": {"kv_cache_gb": KV_GB, "timeout_s": 120.0,
                                                          "restarts": 0}},
                       train={"steps": 3, "checkpoint_every": 1, "threads": 1})
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.step()
        trainer.save()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        position = trainer.sampler.position
        proc = trainer.engine.processes[0]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.proc.wait(30)
        with pytest.raises(ServerError, match=r"server-0 \(http://127\.0\.0\.1:\d+, log .*servers/server-0-port"):
            trainer.step()
    finally:
        trainer.close()
    resumed = Trainer(replace(cfg, train={"steps": 2}), tmp_path, resume=True)
    try:
        assert resumed.step_idx == 1 and resumed.sampler.position == position
        assert all(torch.equal(v, weights[k]) for k, v in resumed.model.state_dict().items())
        resumed.step()
        assert resumed.step_idx == 2
    finally:
        resumed.close()
