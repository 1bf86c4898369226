"""The trainer's shared-prompt, response-only forward against the slow whole-sequence reference."""

import pytest
import torch

from dppo.runtime.models import char_tokenizer, tiny_random_model
from dppo.train.scoring import score_responses, score_responses_reference


def _batch(tok, prompts, G, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.tensor(tok.encode(p)) for p in prompts for _ in range(G)]
    B = len(prompt_ids)
    response_ids = torch.randint(4, len(tok), (B, T), generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    response_ids = torch.where(mask, response_ids, torch.zeros_like(response_ids))
    return prompt_ids, response_ids, mask


@pytest.fixture(scope="module")
def tiny():
    tok = char_tokenizer()
    return tok, tiny_random_model(tok, hidden_size=32, num_layers=2, seed=3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fast_matches_reference_values_and_grads(tiny, temperature):
    tok, model = tiny
    prompt_ids, response_ids, mask = _batch(tok, ["12+3=", "7+80=", "1+1="], G=3, T=5)
    topk_ids = torch.randint(0, len(tok), (*response_ids.shape, 4))
    _assert_matches_reference(model, prompt_ids, response_ids, mask, temperature=temperature, topk_ids=topk_ids)


def _assert_matches_reference(model, prompt_ids, response_ids, mask, *, layout="auto", **kwargs):
    """score_responses vs the reference: log-probs, top-K cells, entropy, zeros at padding, and the gradient of
    every parameter (of the log-probs summed over tokens)."""
    fast = score_responses(model, prompt_ids, response_ids, mask, with_entropy=True, layout=layout, **kwargs)
    (fast.logp * mask).sum().backward()
    g_fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = score_responses_reference(model, prompt_ids, response_ids, mask, with_entropy=True, **kwargs)
    (ref.logp * mask).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.testing.assert_close(fast.logp, ref.logp)
    torch.testing.assert_close(fast.topk_logp[mask], ref.topk_logp[mask])
    torch.testing.assert_close(fast.entropy[mask], ref.entropy[mask])
    assert (fast.logp[~mask] == 0).all()
    for name in g_ref:
        torch.testing.assert_close(g_fast[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_prompts_of_different_lengths_and_shuffled_order(tiny):
    tok, model = tiny
    prompt_ids, response_ids, mask = _batch(tok, ["1+2=", "123+456=", "9="], G=2, T=4, seed=1)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])  # groups interleaved: several prompts, not contiguous
    prompt_ids = [prompt_ids[i] for i in perm]
    response_ids, mask = response_ids[perm], mask[perm]
    with torch.no_grad():
        fast = score_responses(model, prompt_ids, response_ids, mask)
        ref = score_responses_reference(model, prompt_ids, response_ids, mask)
    torch.testing.assert_close(fast.logp, ref.logp)


def test_bf16_autocast_close_to_fp32(tiny):
    tok, model = tiny
    prompt_ids, response_ids, mask = _batch(tok, ["12+3="], G=4, T=6)
    with torch.no_grad():
        ref = score_responses(model, prompt_ids, response_ids, mask).logp
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = score_responses(model, prompt_ids, response_ids, mask).logp
    # bf16 matmuls (8-bit mantissa) over a 32-wide hidden: log-prob errors of order 1e-2 are expected.
    torch.testing.assert_close(low, ref, atol=5e-2, rtol=0)


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_each_layout_matches_reference_values_and_grads(tiny, layout):
    """Both layouts, forced, against the reference: interleaved groups of prompts of different lengths, responses
    of mixed lengths (some one token long), top-K cells and entropy, and the gradient of every parameter."""
    tok, model = tiny
    prompt_ids, response_ids, mask = _batch(tok, ["1+2=", "123+456=", "9="], G=3, T=6, seed=4)
    mask[0, 1:] = False  # a one-token response
    perm = torch.tensor([4, 0, 8, 1, 5, 2, 7, 3, 6])
    prompt_ids = [prompt_ids[i] for i in perm]
    response_ids, mask = response_ids[perm], mask[perm]
    topk_ids = torch.randint(0, len(tok), (*response_ids.shape, 3))
    _assert_matches_reference(model, prompt_ids, response_ids, mask, topk_ids=topk_ids, layout=layout)


def test_packed_layout_on_a_llama_model_with_grouped_query_attention():
    """The packed rows' 4D mask on the Llama architecture (SmolLM2's) with GQA and a tied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         attn_implementation="sdpa"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40, (n,), generator=gen) for n in (7, 3)]
    prompt_ids = [prompts[i // 4] for i in range(8)]
    response_ids = torch.randint(3, 40, (8, 5), generator=gen)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 4, 2, 5, 5, 1])[:, None]
    with torch.no_grad():
        packed = score_responses(model, prompt_ids, response_ids, mask, layout="packed")
        ref = score_responses_reference(model, prompt_ids, response_ids, mask)
    torch.testing.assert_close(packed.logp, ref.logp)


def test_auto_layout_prefers_packing_for_short_rows_and_rejects_bad_input(tiny):
    from dppo.train.scoring import _cheaper_layout

    tok, model = tiny
    decoder = model.get_decoder()
    distinct = [torch.arange(20)]
    owner = torch.zeros(8, dtype=torch.long)
    assert _cheaper_layout(decoder, distinct, owner, torch.full((8,), 4), 16) == "packed"  # mostly padding
    assert _cheaper_layout(decoder, distinct, owner, torch.full((8,), 4000), 4000) == "shared"  # 32k-token row
    prompt_ids, response_ids, mask = _batch(tok, ["1+2="], G=2, T=4)
    mask[0] = torch.tensor([True, False, True, False])  # not a prefix
    with pytest.raises(ValueError, match="response_mask"):
        score_responses(model, prompt_ids, response_ids, mask, layout="packed")
    with pytest.raises(ValueError, match="layout"):
        score_responses(model, prompt_ids, response_ids, mask, layout="tree")
