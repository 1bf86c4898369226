"""The model leaves dppo as a Hugging Face folder (`dppo.run_files.export`): the hf/ folder of a finished run's final
checkpoint and `dppo export RUN_DIR [--step N] OUT [--merged]` load with transformers (and peft, and vLLM) alone,
and give the trainer's log-probs in fp32.

"The trainer's model" is rebuilt as the trainer builds it (`build_model` from the run's config.yaml) with the
checkpoint's weights loaded (`load_checkpoint_weights`, as `--resume` does). The vLLM test runs vLLM in a
subprocess with no dppo import: it loads the folder with its own tokenizer, as `vllm serve` would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VLLM_MARKS
from safetensors.torch import load_file

from dppo.cli import main
from dppo.runtime.models import char_tokenizer
from dppo.train.build import build_model
from dppo.run_files.checkpoint import load_checkpoint
from dppo.run_files.run_dir import checkpoint_path
from dppo.train.config import Config, replace
from dppo.train.evaluation import load_checkpoint_weights

ARGS = ["--preset", "smoke", "--train.steps", "2", "--train.checkpoint-every", "1", "--train.no-eval-before",
        "--log.no-progress", "--log.report-to", "none"]
TEXTS = ["12+34=46", "What is 7 + 8?\nAnswer: 15", "a b\tc ~{}|"]
CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    assert main(["train", *ARGS, "--run-dir", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export-lora") / "run"
    assert main(["train", *ARGS, "--run-dir", str(run), "--model.lora-rank", "4", "--no-hf"]) == 0
    return run


def _trainer_model(run: Path, step: int):
    cfg = replace(Config.load(run / "config.yaml"), model={"device": "cpu"})
    model, tokenizer, _ = build_model(cfg, run)
    path = checkpoint_path(run, step)
    load_checkpoint_weights(model, load_checkpoint(path)["weights"], path, flag="test")
    return model.eval(), tokenizer


def _logp(model, ids: list[int]) -> torch.Tensor:
    """log π(token_t | tokens_<t) of every token after the first, fp32."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False),
            *(tokenizer.encode(t) for t in TEXTS[:2])]


def test_the_final_checkpoint_holds_a_folder_transformers_loads_alone(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run / "checkpoints" / "step_000002" / "hf"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= {p.name for p in hf.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ours, our_tokenizer = _trainer_model(run, 2)
    for text in TEXTS[:2]:  # the same ids (AutoTokenizer picks Qwen2Tokenizer for a qwen2 folder: export.py)
        assert tokenizer.encode(text) == our_tokenizer.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(TEXTS[2]) == [i for i in our_tokenizer.encode(TEXTS[2]) if i != our_tokenizer.unk_token_id]
    assert _ids(tokenizer) == _ids(our_tokenizer)  # the chat template came along
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (our_tokenizer.pad_token_id, our_tokenizer.eos_token_id)
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == our_tokenizer.eos_token_id
    for ids in _ids(our_tokenizer):
        torch.testing.assert_close(_logp(loaded, ids), _logp(ours, ids))
    trained = load_file(str(checkpoint_path(run, 2) / "model.safetensors"))
    exported = load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in trained.items())


def test_export_writes_any_checkpoint_and_names_what_is_missing(run, tmp_path, capsys):
    out = tmp_path / "step1"
    assert main(["export", str(run), "--step", "1", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    trained = load_file(str(checkpoint_path(run, 1) / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
    assert not any(torch.equal(exported[k], v) for k, v in load_file(str(checkpoint_path(run, 2) / "model.safetensors"))
                   .items() if k.endswith("q_proj.weight"))  # step 1, not the newest
    assert not list(tmp_path.glob(".step1.tmp-*"))
    assert main(["export", str(run), "--step", "9", str(tmp_path / "x")]) == 2
    assert "--step: no complete checkpoint step_000009 under" in capsys.readouterr().err
    assert main(["export", str(run), str(out)]) == 2
    assert f"OUT: {out} already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "y")]) == 2
    assert "is not a run directory (no config.yaml)" in capsys.readouterr().err


def test_lora_exports_the_peft_adapter_and_the_merged_model(lora_run, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    ours, tokenizer = _trainer_model(lora_run, 2)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(lora_run), str(adapter)]) == 0
    assert main(["export", str(lora_run), str(merged), "--merged"]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(adapter.absolute() / "base")
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    from_adapter = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()
    from_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in k for k in load_file(str(merged / "model.safetensors")))
    for ids in _ids(tokenizer):
        torch.testing.assert_close(_logp(from_adapter, ids), _logp(ours, ids))
        torch.testing.assert_close(_logp(from_merged, ids), _logp(ours, ids))


VLLM_SCRIPT = r'''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm import LLM, SamplingParams

folder, texts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(folder, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28, max_model_len=256, seed=0)
out = []
for result in llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0)):
    ids = result.prompt_token_ids
    out.append({"ids": ids, "logp": [lp[i].logprob for i, lp in zip(ids[1:], result.prompt_logprobs[1:])]})
print("RESULT " + json.dumps(out))
'''


def _marked(marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test

    return apply


@pytest.mark.slow
@_marked(VLLM_MARKS)
def test_vllm_loads_the_exported_folder_with_no_dppo_code(run, tmp_path):
    hf = run / "checkpoints" / "step_000002" / "hf"
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(hf), json.dumps(TEXTS[:2])], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    ours, tokenizer = _trainer_model(run, 2)
    for text, result in zip(TEXTS[:2], results):
        assert result["ids"] == tokenizer.encode(text)  # vLLM's own tokenizer load gives the trainer's ids
        # fp32 vLLM vs fp32 transformers: |Δ logp| <= 1.6e-5 measured on SmolLM2 (machine-facts.md)
        torch.testing.assert_close(torch.tensor(result["logp"]), _logp(ours, result["ids"]), atol=1e-4, rtol=1e-4)


def test_the_char_tokenizer_round_trips_through_its_exported_form(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from dppo.run_files.export import portable_tokenizer

    tokenizer = char_tokenizer()
    portable_tokenizer(tokenizer).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # what picks Qwen2Tokenizer
    every_char = "".join(t for t in tokenizer.get_vocab() if t not in tokenizer.all_special_tokens)
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        assert loaded.encode(every_char) == tokenizer.encode(every_char)
        assert loaded.decode(loaded.encode(every_char)) == every_char
        assert loaded.get_vocab() == portable_tokenizer(tokenizer).get_vocab()
