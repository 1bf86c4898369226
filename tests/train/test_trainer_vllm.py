"""The `Trainer` with the `vllm` rollout engine (in process, fp32) on the smoke preset's tiny random model.

What only an end-to-end run shows: the trainer builds a vLLM engine, µ (`rollout_logp`, and µ's top-K for the
Top-K trust regions) comes from it, every weight sync reaches it, and the logged metrics are finite.

Every `engine.generate` call is recorded (the rollouts are returned unchanged) together with a copy of the trainer's
weights at that moment; the tests recompute the trainer's log-probs of the recorded responses with the slow
reference scorer under those weights and under the previous ones. Engine and trainer are both fp32 on the same
weights, so µ must equal π to float32 noise: machine-facts measured fp32 vLLM vs fp32 transformers at <= 1.6e-5 on
SmolLM2 (30 layers); the tiny model has 2, and ATOL = 1e-4 leaves margin for kernel summation order while staying
far below what one training step changes (see WEIGHT_CHANGE) and the bf16 mismatch (mean 0.017). Measured here
on CPU: max |µ − π| <= 1e-6 on the same weights; max |µ − π_old| 0.16-0.26 against the previous step's weights.

One trainer (2 steps via `Trainer.train`) serves most tests; the Top-K variant runs one step on its own trainer.
The model is tiny-random (hidden size 64): 2 heads of 32, the smallest head size vLLM's CPU attention supports.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

import pytest
from conftest import VLLM_MARKS
import torch

from dppo.train.config import replace
from dppo.rollout import SamplingParams
from dppo.train.batch import RolloutBatch, collate
from dppo.train.scoring import score_responses_reference
from dppo.train.trainer import Trainer
from conftest import smoke_config

pytestmark = VLLM_MARKS

ATOL = 1e-4
"""|µ − π| in log-probs on identical fp32 weights (see the module docstring for why 1e-4). Also the bound on the
logged `mismatch/*_tv_mean` (probabilities), which are ~1e-9 here."""
WEIGHT_CHANGE = 1e-2
"""One training step (2 AdamW steps at lr 1e-3) must move some recorded token's log-prob by more than this, 100x
ATOL, so that "follows the new weights, not the old" is decided with a wide margin on both sides."""
P, G, STEPS = 2, 4, 2


@dataclass
class Call:
    """One `engine.generate` call: its params, the collated rollouts, and the trainer's weights at that moment."""

    params: SamplingParams
    batch: RolloutBatch
    weights: dict[str, torch.Tensor]


class Recorder:
    """Replaces `trainer.engine.generate` on the instance: calls the real method and returns its rollouts as
    they are, keeping a collated copy and a snapshot of the trainer's weights (those that should be the engine's)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.calls = trainer, []
        self._generate = trainer.engine.generate
        trainer.engine.generate = self

    def __call__(self, prompts, params: SamplingParams):
        rollouts = self._generate(prompts, params)
        weights = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
        self.calls.append(Call(params, collate(rollouts, pad_id=self.trainer.pad_id), weights))
        return rollouts


def _config(run_dir, **sections):
    cfg = smoke_config(run_dir, rollout={"engine": "vllm", "dtype": "float32", "prompts_per_step": P, "group_size": G,
                                         "vllm": {"kv_cache_gb": 0.25, "gpu_memory_utilization": 0.1}},  # two engines
                       task={"eval_size": 4}, train={"steps": STEPS})
    return replace(cfg, **sections) if sections else cfg


def reference(model, weights, batch: RolloutBatch, temperature: float, *, topk: bool = False) -> torch.Tensor:
    """The trainer's log-probs (slow reference scorer) of the batch's responses under `weights`, on the CPU like
    the batch: [B, T], or [B, T, K+1] at µ's top-K cells when `topk`."""
    model.load_state_dict(weights)
    with torch.no_grad():
        scores = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                           temperature=temperature, topk_ids=batch.rollout_topk_ids if topk else None)
    return (scores.topk_logp if topk else scores.logp).cpu()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`Trainer.train` for two steps with the vLLM engine; yields (trainer, its recorded generate calls, run dir,
    what `train` returned)."""
    run_dir = tmp_path_factory.mktemp("trainer-vllm")
    trainer = Trainer(_config(run_dir), run_dir)
    try:
        recorder = Recorder(trainer)
        results = trainer.train()
        yield trainer, recorder.calls, run_dir, results
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def scratch(run):
    """A copy of the trainer's model to load recorded weights into (the trainer's own is left alone)."""
    return copy.deepcopy(run[0].model).eval()


def test_trainer_builds_a_vllm_engine_in_fp32(run):
    from dppo.rollout.vllm import VLLMEngine

    trainer, calls, _, results = run
    assert type(trainer.engine) is VLLMEngine
    assert trainer.engine.dtype == torch.float32
    assert next(trainer.model.parameters()).dtype == torch.float32
    # the two training steps, then the held-out evaluation after training (eval_before is off)
    assert len(calls) == STEPS + 1 and results["step"] == STEPS
    assert [c.batch.response_ids.shape[0] for c in calls[:STEPS]] == [P * G] * STEPS


def test_rollout_logp_is_recorded_and_equals_trainer_logp_at_step_1(run, scratch):
    trainer, calls, _, _ = run
    first = calls[0]
    mask, mu = first.batch.response_mask, first.batch.rollout_logp
    assert bool(mask.any())
    assert bool(torch.isfinite(mu).all()) and bool((mu <= 0).all())
    assert bool((mu[mask] != 0).all()) and bool((mu[~mask] == 0).all())
    pi = reference(scratch, first.weights, first.batch, trainer.cfg.rollout.temperature)
    torch.testing.assert_close(mu[mask], pi[mask], atol=ATOL, rtol=0)


@pytest.mark.parametrize("i", range(1, STEPS + 1), ids=lambda i: f"after-step-{i}")
def test_each_weight_sync_reaches_the_engine(run, scratch, i):
    """Call i (step i+1, or the evaluation after the last step) samples from the weights of the end of step i:
    µ equals the trainer's log-probs under them, and is measurably different from those under the weights before."""
    _, calls, _, _ = run
    call, previous = calls[i], calls[i - 1]
    assert int(call.batch.weight_version.unique()) == int(previous.batch.weight_version.unique()) + 1
    changed = [k for k in call.weights if not torch.equal(call.weights[k], previous.weights[k])]
    assert changed, "the optimiser did not change any weight"
    mask, mu = call.batch.response_mask, call.batch.rollout_logp
    new = reference(scratch, call.weights, call.batch, call.params.temperature)
    old = reference(scratch, previous.weights, call.batch, call.params.temperature)
    torch.testing.assert_close(mu[mask], new[mask], atol=ATOL, rtol=0)
    assert (mu[mask] - old[mask]).abs().max() > WEIGHT_CHANGE


def test_every_step_logs_finite_loss_and_mismatch(run):
    _, _, run_dir, _ = run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["optim/grad_norm"])
        assert r["optim/skipped_steps_total"] == 0
        # fp32 engine and trainer on the same weights: |π − µ| (probabilities) is float32 noise
        assert 0 <= r["mismatch/binary_tv_mean"] < ATOL


def test_topk_trust_region_records_mu_topk_and_trains(tmp_path):
    K = 5
    cfg = _config(tmp_path, loss={"trust_region": "dppo_topk_tv"}, rollout={"top_k_logprobs": K},
                  train={"steps": 1})
    trainer = Trainer(cfg, tmp_path)
    try:
        recorder = Recorder(trainer)
        metrics = trainer.step()
        scratch = copy.deepcopy(trainer.model).eval()
    finally:
        trainer.close()
    assert math.isfinite(metrics["loss/policy"]) and math.isfinite(metrics["optim/grad_norm"])
    assert 0 <= metrics["mismatch/topk_tv_mean"] < ATOL
    (call,) = recorder.calls
    batch = call.batch
    B, T = batch.response_ids.shape
    assert B == P * G
    assert batch.rollout_topk_logp is not None and batch.rollout_topk_logp.shape == (B, T, K + 1)
    assert batch.rollout_topk_ids.shape == batch.rollout_topk_valid.shape == (B, T, K + 1)
    valid = batch.rollout_topk_valid
    assert bool(valid[batch.response_mask][:, :K].all()) and not bool(valid[~batch.response_mask].any())
    assert bool(torch.isfinite(batch.rollout_topk_logp).all()) and bool((batch.rollout_topk_logp[valid] < 0).all())
    # µ's top-K cells are π's log-probs at those ids (same fp32 weights)
    pi = reference(scratch, call.weights, batch, cfg.rollout.temperature, topk=True)
    torch.testing.assert_close(batch.rollout_topk_logp[valid], pi[valid], atol=ATOL, rtol=0)
