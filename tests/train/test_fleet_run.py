"""A run with a mixed fleet (rollout.fleet, `dppo.rollout.fleet`): what the config refuses naming rollout.fleet, the
command line's choice of a fleet over a preset's engine, the resolved config (config.yaml keeps the members and
their nodes), and a short training run on three hf members of different precisions that logs the per-engine
metrics of every member."""

from __future__ import annotations

import json
import math

import pytest
from conftest import smoke_config

from dppo.cli import parse_config
from dppo.rollout.fleet import FleetEngine
from dppo.rollout.quantize import QuantizedEngine
from dppo.rollout.settings import HFSettings
from dppo.train.rollout_build import fleet_specs
from dppo.train.config import Config, ConfigError
from dppo.train.resolve import resolve_config

FLEET = "hf:float32,hf:bfloat16,hf:float32:fp8"


def _cfg(tmp_path, fleet=FLEET, **rollout):
    return smoke_config(tmp_path, rollout={"engine": "auto", "dtype": "auto", "fleet": fleet, **rollout})


@pytest.mark.parametrize("rollout, match", [
    ({"engine": "hf"}, r"leave rollout\.engine auto \(got 'hf'\)"),
    ({"dtype": "float32"}, r"leave rollout\.dtype auto"),
    ({"quantization": "fp8"}, r"leave rollout\.quantization none"),
    ({"mode": "async"}, r"needs rollout\.mode sync"),
    ({"in_flight_updates": True}, r"needs rollout\.mode sync without in-flight updates"),
    ({"episodes": "env"}, r"needs rollout\.episodes single, got 'env'"),
    ({"fleet": "vllm:float32,vllm:bfloat16"}, r"at most one in-process vllm member"),
    ({"fleet": "vllm-server:float32,vllm-server:bfloat16", "vllm_server": {"urls": "http://127.0.0.1:8000"}},
     r"two vllm-server members would share the servers"),
    ({"fleet": "hf:float32"}, r"expected two or more members"),
    ({"fleet": "hf:float32,hf:fp8"}, r"unknown dtype 'fp8'"),
    ({"fleet": "hf:float32,hf:float32,hf:float32,hf:float32,hf:float32"},
     r"5 members but rollout\.prompts_per_step = 4"),
])
def test_what_a_fleet_cannot_do_is_refused_naming_it(tmp_path, rollout, match):
    with pytest.raises(ConfigError, match=rf"^rollout\.fleet: .*{match}"):
        _cfg(tmp_path, **rollout)


def test_a_node_of_a_kind_the_fleet_lacks_is_refused_and_its_members_nodes_are_kept(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.kv_cache_gb: a setting of the vllm engine, but "
                                          r"rollout\.fleet has no vllm member"):
        _cfg(tmp_path, vllm={"kv_cache_gb": 3.0})
    cfg = _cfg(tmp_path, fleet="hf:float32,vllm-server:bfloat16", hf={"max_batch_rows": 4},
               vllm_server={"kv_cache_gb": 0.5})
    assert [k for k in cfg.to_dict()["rollout"] if k in ("hf", "vllm", "vllm_server")] == ["hf", "vllm_server"]
    with pytest.raises(ConfigError, match=r"^rollout\.fleet: .*'adapter' would send every member only the adapter"):
        _cfg(tmp_path, fleet="hf:float32,vllm-server:bfloat16", vllm_server={"lora_sync": "adapter"})
    _cfg(tmp_path, fleet="hf:float32:fp8,hf:float32", hf={"fp8_activations": True})  # an fp8 hf member: allowed
    with pytest.raises(ConfigError, match=r"^rollout\.hf\.fp8_activations: needs rollout\.quantization fp8"):
        _cfg(tmp_path, hf={"fp8_activations": True}, fleet="hf:float32,hf:bfloat16")


def test_a_member_that_records_no_top_k_is_refused_for_a_top_k_trust_region(tmp_path, monkeypatch):
    monkeypatch.setattr(HFSettings, "can_record_top_k", False)
    _cfg(tmp_path)
    with pytest.raises(ConfigError, match=r"^rollout\.fleet: the hf engine does not record µ's top-K log-probs"):
        smoke_config(tmp_path, rollout={"engine": "auto", "dtype": "auto", "fleet": FLEET},
                     loss={"trust_region": "dppo_topk_tv"})


def test_the_command_line_chooses_a_fleet_over_a_presets_engine_and_config_yaml_keeps_it(tmp_path):
    cfg, _, _ = parse_config(["--preset", "smoke", "--rollout.fleet", "hf:float32, hf:bfloat16"], prog="dppo train")
    assert (cfg.rollout.engine, cfg.rollout.dtype) == ("auto", "auto")  # the smoke preset's hf/float32 went
    with pytest.raises(ConfigError, match=r"^command line: could not parse"):
        parse_config(["--preset", "smoke", "--rollout.fleet", FLEET, "--rollout.engine", "hf"], prog="dppo train")
    resolved = resolve_config(cfg)
    assert (resolved.rollout.fleet, resolved.rollout.engine, resolved.rollout.dtype) == (
        "hf:float32,hf:bfloat16", "auto", "auto")  # the members, in the form the run announces them
    assert resolve_config(resolved) == resolved
    resolved.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == resolved


def test_each_member_gets_its_own_spec(tmp_path):
    specs = fleet_specs(_cfg(tmp_path, fleet="hf:float32,hf:bfloat16:fp8,vllm-server:bfloat16"), run_dir=tmp_path)
    assert [(s.kind, s.dtype, s.quantization) for s in specs] == [
        ("hf", "float32", "none"), ("hf", "bfloat16", "fp8"), ("vllm-server", "bfloat16", "none")]
    assert len({s.seed for s in specs}) == 3
    assert [s.log_dir for s in specs] == [str(tmp_path / "servers" / f"engine_{j}") for j in range(3)]


def test_a_fleet_run_logs_every_members_metrics(tmp_path, capsys):
    """Three hf members (float32, bfloat16, float32 with fp8 weights) against the fp32 trainer, the smoke preset's 3 steps and the
    evaluation after: each step logs each member's share, reward, mismatch and masked share, all finite; the fp32
    member's mismatch is float rounding, the others' are not; the members' mismatch, weighted by their tokens, is
    the step's."""
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"engine": "auto", "dtype": "auto", "fleet": FLEET, "prompts_per_step": 6},
                       train={"mini_batches": 1})  # (one mini-batch: the step's mismatch is all of it before the update)
    with Trainer(cfg, tmp_path) as trainer:
        assert isinstance(trainer.engine, FleetEngine) and isinstance(trainer.engine.members[2], QuantizedEngine)
        result = trainer.train()
    assert result["step"] == 3 and "eval_after" in result
    assert "[dppo] rollout: fleet engine_0 = hf float32, engine_1 = hf bfloat16, engine_2 = hf float32 fp8" \
        in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/binary_tv_mean" in r]
    assert len(rows) == 3
    for row in rows:
        for j in range(3):
            for name in ("rollout/frac", "reward/mean", "reward/accuracy", "response/length_mean",
                         "mismatch/binary_tv", "trust_region/masked_frac"):
                assert math.isfinite(row[f"{name}_engine_{j}"]), (name, j)
        assert [row[f"rollout/frac_engine_{j}"] for j in range(3)] == pytest.approx([1 / 3] * 3)  # 6 prompts in turn
        tokens = [row[f"rollout/frac_engine_{j}"] * row[f"response/length_mean_engine_{j}"] for j in range(3)]
        weighted = sum(t * row[f"mismatch/binary_tv_engine_{j}"] for j, t in enumerate(tokens)) / sum(tokens)
        assert weighted == pytest.approx(row["mismatch/binary_tv_mean"], rel=1e-4)
        assert row["mismatch/binary_tv_engine_0"] < 1e-6 < row["mismatch/binary_tv_engine_1"]
        assert row["mismatch/binary_tv_engine_2"] > 1e-6


def test_a_single_engine_run_logs_no_per_engine_metric(tmp_path):
    from dppo.train.trainer import Trainer

    with Trainer(smoke_config(tmp_path), tmp_path) as trainer:
        metrics = trainer.step()
    assert "mismatch/binary_tv_mean" in metrics and not [k for k in metrics if "_engine_" in k]


def test_dppo_eval_samples_with_the_fleet(tmp_path):
    from dppo.train.evaluation import evaluate_checkpoint

    result = evaluate_checkpoint(_cfg(tmp_path), None)
    assert result["source"] == "base model" and 0.0 <= result["pass@1"] <= 1.0
