"""A run with several engines (rollout.engines; `--rollout.fleet`, `dppo.rollout.fleet`): what the config refuses
naming the field, the command line's choice of a fleet over a preset's engine, the resolved config (config.yaml keeps
the engines and each one's settings), and a short training run on three hf members of different precisions that logs the per-engine
metrics of every member."""

from __future__ import annotations

import json
import math

import pytest
from conftest import smoke_config

from dppo.cli import parse_config
from dppo.rollout.fleet import FleetEngine
from dppo.rollout.quantize import QuantizedEngine
from dppo.rollout.settings import EngineNode, HFSettings, VLLMServerSettings
from dppo.train.rollout_build import engine_specs
from dppo.train.config import Config, ConfigError, replace
from dppo.train.resolve import resolve_config

FLEET = "hf:float32,hf:bfloat16,hf:float32:fp8"


def _cfg(tmp_path, fleet=FLEET, **rollout):
    return smoke_config(tmp_path, rollout={"fleet": fleet, **rollout})


@pytest.mark.parametrize("rollout, match", [
    ({"engine": "hf"}, r"^rollout\.fleet: each member names its engine, dtype and fp8 .*leave rollout\.engine out "
                       r"\(got 'hf'\)"),
    ({"dtype": "float32"}, r"^rollout\.fleet: .*leave rollout\.dtype out"),
    ({"quantization": "fp8"}, r"^rollout\.fleet: .*leave rollout\.quantization out"),
    ({"in_flight_updates": True}, r"^rollout\.in_flight_updates: needs rollout\.mode async"),
    ({"episodes": "env"}, r"^rollout\.fleet: several engines in one process need rollout\.episodes single, got 'env'"),
    ({"fleet": "vllm:float32,vllm:bfloat16"}, r"^rollout\.engines: at most one vllm engine"),
    ({"fleet": "vllm-server:float32,vllm-server:bfloat16", "vllm_server": {"urls": "http://127.0.0.1:8000"}},
     r"^rollout\.engines\[1\]: engines 0 and 1 would share the server http://127\.0\.0\.1:8000"),
    ({"fleet": "hf:float32,hf:fp8"}, r"^rollout\.fleet: unknown dtype 'fp8'"),
    ({"fleet": "hf:float32,hf:float32,hf:float32,hf:float32,hf:float32"},
     r"^rollout\.fleet: 5 engines but rollout\.prompts_per_step = 4"),
    ({"mode": "async", "devices": "cpu,cpu"}, r"^rollout\.devices: 2 rollout workers for 3 engines"),
])
def test_what_several_engines_cannot_do_is_refused_naming_the_field(tmp_path, rollout, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, **rollout)


def test_a_fleet_of_one_is_one_engine_and_engine_auto_beside_a_fleet_is_accepted(tmp_path):
    assert _cfg(tmp_path, fleet="hf:bfloat16:fp8").rollout.engines == (EngineNode("hf", "bfloat16", fp8=True),)
    cfg = _cfg(tmp_path, engine="auto", dtype="auto", quantization="none")  # (the defaults: nothing to refuse)
    assert [n.describe() for n in cfg.rollout.engines] == ["hf float32", "hf bfloat16", "hf float32 fp8"]


def test_a_setting_of_a_kind_the_list_lacks_is_refused_and_each_engine_keeps_its_kinds_settings(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.kv_cache_gb: a setting of the vllm engine, but the run's "
                                          r"engines are 'hf'"):
        _cfg(tmp_path, vllm={"kv_cache_gb": 3.0})
    cfg = _cfg(tmp_path, fleet="hf:float32,vllm-server:bfloat16", hf={"max_batch_rows": 4},
               vllm_server={"kv_cache_gb": 0.5})
    assert [n.settings for n in cfg.rollout.engines] == [HFSettings(max_batch_rows=4), VLLMServerSettings(kv_cache_gb=0.5)]
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.lora_sync: 'adapter' in one engine and merged "
                                          r"weights in another"):
        smoke_config(tmp_path, model={"lora_rank": 4}, rollout={"fleet": "hf:float32,vllm-server:bfloat16",
                                                                 "vllm_server": {"lora_sync": "adapter"}})
    _cfg(tmp_path, fleet="hf:float32:fp8,hf:float32", hf={"fp8_activations": True})  # an fp8 hf engine: allowed
    with pytest.raises(ConfigError, match=r"^rollout\.hf\.fp8_activations: needs an hf engine with fp8 weights"):
        _cfg(tmp_path, hf={"fp8_activations": True}, fleet="hf:float32,hf:bfloat16")


def test_an_engine_that_records_no_top_k_is_refused_for_a_top_k_trust_region(tmp_path, monkeypatch):
    monkeypatch.setattr(HFSettings, "can_record_top_k", False)
    _cfg(tmp_path)
    with pytest.raises(ConfigError, match=r"^rollout\.top_k_logprobs: the hf engine does not record µ's top-K"):
        smoke_config(tmp_path, rollout={"fleet": FLEET}, loss={"trust_region": "dppo_topk_tv"})


def test_the_command_line_chooses_a_fleet_over_a_presets_engine_and_config_yaml_keeps_it(tmp_path):
    cfg, _, _ = parse_config(["--preset", "smoke", "--rollout.fleet", "hf:float32, hf:bfloat16"], prog="dppo train")
    assert [(n.kind, n.dtype) for n in cfg.rollout.engines] == [("hf", "float32"), ("hf", "bfloat16")]
    with pytest.raises(ConfigError, match=r"^command line: could not parse .*rollout\.fleet: .*leave rollout\.engine "
                                          r"out \(got 'hf'\)"):
        parse_config(["--preset", "smoke", "--rollout.fleet", FLEET, "--rollout.engine", "hf"], prog="dppo train")
    resolved = resolve_config(cfg)
    assert resolved.rollout.engines == cfg.rollout.engines
    assert resolve_config(resolved) == resolved
    resolved.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == resolved
    again, _, _ = parse_config(["--config", str(tmp_path / "config.yaml"), "--rollout.hf.max-batch-rows", "2"],
                               prog="dppo train")  # a kind's flag: every engine of that kind
    assert [n.settings.max_batch_rows for n in again.rollout.engines] == [2, 2]


def test_each_engine_gets_its_own_spec(tmp_path):
    specs = engine_specs(_cfg(tmp_path, fleet="hf:float32,hf:bfloat16:fp8,vllm-server:bfloat16"), run_dir=tmp_path)
    assert [(s.kind, s.dtype, s.quantization, s.index) for s in specs] == [
        ("hf", "float32", "none", 0), ("hf", "bfloat16", "fp8", 1), ("vllm-server", "bfloat16", "none", 2)]
    assert len({s.seed for s in specs}) == 3
    assert [s.log_dir for s in specs] == [str(tmp_path / "servers" / f"engine_{j}") for j in range(3)]


def test_a_fleet_run_logs_every_members_metrics(tmp_path, capsys):
    """Three hf members (float32, bfloat16, float32 with fp8 weights) against the fp32 trainer, the smoke preset's 3 steps and the
    evaluation after: each step logs each member's share, reward, mismatch and masked share, all finite; the fp32
    member's mismatch is float rounding, the others' are not; the members' mismatch, weighted by their tokens, is
    the step's."""
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"fleet": FLEET, "prompts_per_step": 6},
                       train={"mini_batches": 1})  # (one mini-batch: the step's mismatch is all of it before the update)
    with Trainer(cfg, tmp_path) as trainer:
        assert isinstance(trainer.engine, FleetEngine) and isinstance(trainer.engine.members[2], QuantizedEngine)
        result = trainer.train()
    assert result["step"] == 3 and "eval_after" in result
    assert "[dppo] rollout: engines engine_0 = hf float32, engine_1 = hf bfloat16, engine_2 = hf float32 fp8" \
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


def test_an_async_fleet_with_a_lagged_engine_trains_two_steps(tmp_path):
    """rollout.mode async with two hf engines, the second one step behind (`lag: 1`): worker i holds engine i mod 2,
    each response is tagged with its engine, and at max_staleness 0 only the lagged engine's responses are stale
    (staleness 1 from the second step on, within the bound max_staleness + lag)."""
    import dataclasses

    from dppo.train.trainer import Trainer

    base = smoke_config(tmp_path, rollout={"fleet": "hf:float32,hf:float32", "mode": "async", "max_staleness": 0,
                                           "worker_threads": 1}, train={"steps": 2}, task={"eval_size": 0})
    fresh, stale = base.rollout.engines
    cfg = replace(base, rollout={"engines": (fresh, dataclasses.replace(stale, lag=1))})
    with Trainer(cfg, tmp_path) as trainer:
        assert trainer.source.max_staleness == 1 and len(trainer.source.pool.devices) == 2
        trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/binary_tv_mean" in r]
    assert len(rows) == 2
    assert [r["rollout/frac_engine_1"] for r in rows] == [0.5, 0.5]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1]  # the lagged engine, once a newer version exists
    assert rows[1]["rollout/staleness_mean"] == pytest.approx(0.5)  # its half of the responses, not the other's
