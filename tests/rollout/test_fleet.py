"""A mixed fleet (`dppo.rollout.fleet`, rollout.fleet): hf engines of different precisions (float32, bfloat16, float32
with fp8 weights) as one engine on the tiny seeded model — rollouts prompt-major and tagged, whole groups on one
member, each member's µ its own model's distribution, weights to every member, members seeded apart. A vllm-server
member beside an hf member: tests/rollout/test_fleet_server.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dppo.rollout import Engine, SamplingParams
from dppo.rollout.fleet import SEED_STRIDE, FleetEngine
from dppo.rollout.hf import HFEngine
from dppo.rollout.quantize import QuantizedEngine, fp8_weights
from dppo.train.batch import collate
from dppo.train.scoring import score_responses_reference

PARAMS = SamplingParams(n=3, temperature=0.8, max_new_tokens=12, seed=1)


def _prompts(count: int) -> list[list[dict]]:
    questions = ["What is 2+3?", "Compute 17*23-4.", "Is 91 prime?", "Say hi.", "7*8?", "Name a colour."]
    return [[{"role": "user", "content": q}] for q in questions[:count]]


def _fleet(model, tokenizer) -> FleetEngine:
    """float32, bfloat16, float32 with fp8 weights (members 0, 1, 2), holding `model`'s weights."""
    fleet = FleetEngine([HFEngine(model, tokenizer, dtype=torch.float32), HFEngine(model, tokenizer, dtype=torch.bfloat16),
                         QuantizedEngine(HFEngine(model, tokenizer, dtype=torch.float32))])
    fleet.load_weights(model)
    return fleet


def _reference(model, dtype: str):
    """`model` as the member of `dtype` computes it: a float32 copy, a bfloat16 copy, or fp8 weights in float32."""
    ref = copy.deepcopy(model)
    if dtype == "bf16":
        return ref.to(torch.bfloat16)
    if dtype == "fp8":
        ref.load_state_dict(fp8_weights(model.state_dict()))
    return ref


def test_rollouts_come_prompt_major_with_whole_groups_dealt_in_turn(tiny_model, tokenizer):
    fleet = _fleet(tiny_model, tokenizer)
    try:
        assert isinstance(fleet, Engine)
        rollouts = fleet.generate(_prompts(5), PARAMS)
        assert [r.prompt_index for r in rollouts] == [i for i in range(5) for _ in range(PARAMS.n)]
        assert [r.engine for r in rollouts] == [i % 3 for i in range(5) for _ in range(PARAMS.n)]  # a group: one member
        two = fleet.generate(_prompts(2), PARAMS)  # fewer prompts than members: the last member sits out
        assert [r.engine for r in two] == [0, 0, 0, 1, 1, 1]
    finally:
        fleet.close()


def test_each_members_mu_is_its_own_models_distribution(tiny_model, tokenizer):
    """fp32 and fp8 members against a plain float32 forward of their model (1e-5: float32 arithmetic along another
    path); the bf16 member against a bf16 forward, which rounds along another path (KV cache vs whole sequence):
    measured mean |Δ| 0.003 against the bf16 model, 0.024 against the fp32 one."""
    fleet = _fleet(tiny_model, tokenizer)
    try:
        batch = collate(fleet.generate(_prompts(6), PARAMS), pad_id=0)
    finally:
        fleet.close()
    with torch.no_grad():
        ref = {name: score_responses_reference(_reference(tiny_model, name), batch.prompt_ids, batch.response_ids,
                                               batch.response_mask, temperature=PARAMS.temperature).logp.float()
               for name in ("fp32", "bf16", "fp8")}
    for j, name in enumerate(("fp32", "bf16", "fp8")):
        rows = batch.engine == j
        mask = batch.response_mask[rows]
        diff = {k: (batch.rollout_logp[rows] - v[rows])[mask].abs() for k, v in ref.items()}
        if name == "bf16":
            assert diff["bf16"].mean() < 0.3 * diff["fp32"].mean(), {k: float(v.mean()) for k, v in diff.items()}
        else:
            torch.testing.assert_close(diff[name], torch.zeros_like(diff[name]), rtol=0, atol=1e-5)
            other = "fp8" if name == "fp32" else "fp32"
            assert diff[other].max() > 1e-2  # and not the other members' model


def test_a_member_samples_as_the_same_engine_alone_given_its_share(tiny_model, tokenizer):
    """Member j gets prompts j, j+M, ... with seed + j·SEED_STRIDE: a lone engine of its dtype given exactly that
    samples the same tokens and records the same µ, bit for bit."""
    fleet = _fleet(tiny_model, tokenizer)
    alone = HFEngine(tiny_model, tokenizer, dtype=torch.bfloat16)
    try:
        rollouts = fleet.generate(_prompts(6), PARAMS)
        lone = alone.generate([_prompts(6)[i] for i in (1, 4)],
                              dataclasses.replace(PARAMS, seed=PARAMS.seed + SEED_STRIDE))
    finally:
        fleet.close()
        alone.close()
    member = [r for r in rollouts if r.engine == 1]
    assert len(member) == len(lone) == 2 * PARAMS.n
    for got, want in zip(member, lone):
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.rollout_logp, want.rollout_logp)


def test_members_draw_apart_and_a_seed_reproduces_the_call(tiny_model, tokenizer):
    engines = [HFEngine(tiny_model, tokenizer), HFEngine(tiny_model, tokenizer)]
    fleet = FleetEngine(engines)
    try:
        same = _prompts(1) * 2  # the same prompt on both float32 members
        first = fleet.generate(same, PARAMS)
        again = fleet.generate(same, PARAMS)
    finally:
        fleet.close()
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(first, again))
    by_member = [[r.response_ids.tolist() for r in first if r.engine == j] for j in (0, 1)]
    assert by_member[0] != by_member[1]  # (without the seed stride both members would draw the same samples)


def test_weights_reach_every_member_and_fp8_quantises_its_copy(make_tiny_model, tokenizer):
    fleet = _fleet(make_tiny_model(seed=0), tokenizer)
    new = make_tiny_model(seed=3)
    try:
        fleet.load_weights(new.state_dict())
        assert fleet.weight_version == 2
        fp32, bf16, fp8 = (dict(m.model.named_parameters()) for m in fleet.members)
        for name, w in new.named_parameters():
            torch.testing.assert_close(fp32[name], w.detach(), rtol=0, atol=0)
            torch.testing.assert_close(bf16[name], w.detach().bfloat16(), rtol=0, atol=0)
            torch.testing.assert_close(fp8[name], fp8_weights({name: w.detach()})[name], rtol=0, atol=0)
    finally:
        fleet.close()


def test_max_logprobs_metrics_and_close(tiny_model, tokenizer):
    a, b = HFEngine(tiny_model, tokenizer), HFEngine(tiny_model, tokenizer)
    a.max_logprobs = 20
    b.metrics = lambda: {"restarts": 2.0}  # an engine with counters of its own (e.g. a server's restarts)
    fleet = FleetEngine([a, b])
    assert fleet.max_logprobs == 20 and fleet.metrics() == {"engine_1/restarts": 2.0}

    def fail():
        raise RuntimeError("close failed")

    a.close = fail
    with pytest.raises(RuntimeError, match="close failed"):
        fleet.close()
    assert b.model is None  # the other member was closed all the same


def test_a_member_error_names_the_member(tiny_model, tokenizer):
    fleet = FleetEngine([HFEngine(tiny_model, tokenizer), HFEngine(tiny_model, tokenizer)])
    try:
        with pytest.raises(ValueError, match="max_new_tokens") as info:
            fleet.generate(_prompts(2), dataclasses.replace(PARAMS, max_new_tokens=10**6))
        assert "engine_0" in "".join(info.value.__notes__)
    finally:
        fleet.close()


