"""Learning test: DPPO must raise the training reward of a warm-started tiny model by a clear margin.

A character-level tiny Qwen2 is first trained supervised (dppo.studies.sft) on one-digit addition to a low but
nonzero accuracy; then DPPO-Binary-TV with bf16 rollouts (a real engine/trainer mismatch) and 2
mini-batches per rollout batch trains it. Fixed seeds; the margins are assertions.
"""

import json

import pytest

from dppo.train.config import Config, replace
from dppo.runtime.models import char_tokenizer, save_model, tiny_random_model
from dppo.studies.sft import sft_warm_start
from dppo.tasks import make_task
from dppo.train.trainer import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    tok = char_tokenizer()
    task = make_task("addition", digits=1, size=80, eval_size=20, seed=0)
    model = tiny_random_model(tok, hidden_size=128, num_layers=2, seed=0)
    sft_warm_start(model, tok, list(task.train), steps=60, batch_size=64, lr=3e-3, seed=0)
    folder = tmp_path_factory.mktemp("warm") / "model"
    save_model(model, tok, folder)
    return folder


def learning_config(model_dir, run_dir, trust_region="dppo_binary_tv") -> Config:
    return replace(
        Config(),
        model={"name": str(model_dir)},
        rollout={"engine": "hf", "dtype": "bfloat16", "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 4},
        task={"name": "addition", "options": '{"digits": 1}', "size": 80, "eval_size": 20},
        loss={"trust_region": trust_region},
        optim={"lr": 3e-4},
        train={"steps": 60, "mini_batches": 2, "micro_batch_size": 64, "eval_before": True},
        log={"run_dir": str(run_dir), "tensorboard": False, "progress": False, "samples_per_step": 0},
    )


def test_dppo_raises_training_reward(warm_model, tmp_path):
    trainer = Trainer(learning_config(warm_model, tmp_path), tmp_path)
    try:
        results = trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"training reward {start:.3f} -> {end:.3f}; eval {results['eval_before']} -> {results['eval_after']}")
    assert 0.02 < start < 0.7, f"warm start not in the learnable range: {start:.3f}"
    assert end >= start + 0.08, f"reward did not rise enough: {start:.3f} -> {end:.3f}"
