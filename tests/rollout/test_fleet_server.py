"""A mixed fleet with a server member (`dppo.rollout.fleet`): a float32 vllm-server member beside a float32 hf member on
the tiny seeded model. The server is the fake one (`fake_vllm_server.py`, healthy in seconds): the fleet's logic is
what is tested here; a real vLLM server's µ and top-K against a plain forward are test_server_engine.py's."""

from __future__ import annotations

import pytest
import torch
from conftest import VLLM_MARKS
from server_processes import KV_GB, fake_vllm, model_dir, start  # noqa: F401 (fixtures)

from dppo.rollout import SamplingParams, make_engine
from dppo.rollout.fleet import FleetEngine
from dppo.rollout.hf import HFEngine
from dppo.rollout.settings import VLLMServerSettings
from dppo.runtime.models import save_model
from dppo.train.batch import collate
from dppo.train.scoring import score_responses_reference

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35], [40, 41, 42]]


def test_a_vllm_server_member_beside_an_hf_member(fake_vllm, make_tiny_model, tokenizer, tmp_path):
    """Rollouts prompt-major, prompt i from member i mod 2, after one weight sync to both; each member's µ is the
    new fp32 model's (1e-4, as in test_server_engine)."""
    model = make_tiny_model(seed=0, num_heads=2, num_kv_heads=1)  # head size 32, the smallest vLLM-CPU supports
    new = make_tiny_model(seed=5, num_heads=2, num_kv_heads=1)
    folder = save_model(model, tokenizer, tmp_path / "model")
    server = make_engine("vllm-server", folder, tokenizer, VLLMServerSettings(kv_cache_gb=0.25), seed=0,
                         log_dir=tmp_path / "logs")
    fleet = FleetEngine([server, HFEngine(model, tokenizer)])
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=12, top_k_logprobs=4)
    try:
        fleet.load_weights(new.state_dict())
        assert fleet.weight_version == 1 and fleet.max_logprobs == server.max_logprobs
        batch = collate(fleet.generate(PROMPTS, params), pad_id=0)
    finally:
        fleet.close()
    assert batch.prompt_index.tolist() == [i for i in range(4) for _ in range(3)]
    assert batch.engine.tolist() == [i % 2 for i in range(4) for _ in range(3)]
    with torch.no_grad():
        ref = score_responses_reference(new, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                        temperature=0.8, topk_ids=batch.rollout_topk_ids)
    mask = batch.response_mask
    assert torch.allclose(ref.logp[mask], batch.rollout_logp[mask], rtol=0, atol=1e-4)
    valid = batch.rollout_topk_valid & mask[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=1e-4)


def test_two_server_engines_on_their_own_urls_train_two_steps(fake_vllm, model_dir, tmp_path):
    """rollout.engines = two vllm-server engines, each attached to its own running server (a config, not code): two
    training steps, each engine sampling half the prompts under the step's weights (both servers get every sync:
    the fp32 fake servers' µ matches the trainer's π to float rounding at every step)."""
    import json

    from conftest import smoke_config

    from dppo.rollout.settings import EngineNode
    from dppo.train.config import replace
    from dppo.train.trainer import Trainer

    first, second = start(model_dir, tmp_path / "a"), start(model_dir, tmp_path / "b")
    try:
        engines = tuple(EngineNode("vllm-server", "float32", settings=VLLMServerSettings(
            urls=proc.url, kv_cache_gb=KV_GB, timeout_s=120.0)) for proc in (first, second))
        cfg = replace(smoke_config(tmp_path, model={"name": str(model_dir)}, train={"steps": 2, "threads": 1},
                                   task={"eval_size": 0}),
                      rollout={"engines": engines})
        with Trainer(cfg, tmp_path) as trainer:
            assert [m.group.members[0].client.url for m in trainer.engine.members] == [first.url, second.url]
            trainer.train()
    finally:
        first.stop()
        second.stop()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/binary_tv_mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert [row[f"rollout/frac_engine_{j}"] for j in range(2)] == [0.5, 0.5]
        assert all(row[f"mismatch/binary_tv_engine_{j}"] < 1e-5 for j in range(2)), row  # the step's weights, both
