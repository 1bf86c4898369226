"""The vllm-server engine's settings (its node, rollout.vllm_server): refused before anything starts when they cannot
apply (naming the field and the engine that takes it), and carried as they are into the engine spec every rollout
worker builds its engine from."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import smoke_config

from dppo.rollout.settings import ENGINES, VLLMServerSettings
from dppo.train.build import engine_spec
from dppo.train.config import Config, ConfigError


def _cfg(tmp_path, rollout=None, **server):
    return smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32", **(rollout or {}),
                                           "vllm_server": server})


@pytest.mark.parametrize("field, value", [("servers", 2), ("urls", "http://127.0.0.1:8000"), ("partial", "abort"),
                                          ("args", "--max-num-seqs 8"), ("weights_dir", "/tmp/w"),
                                          ("kv_cache_gb", 0.5)])
def test_server_settings_under_another_engine_are_refused_naming_the_engine(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"^rollout\.vllm_server\.{field}: a setting of the vllm-server engine, "
                                          rf"but the run's engine is 'hf'"):
        _cfg(tmp_path, rollout={"engine": "hf"}, **{field: value})


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_engine_node_is_refused_under_every_other_engine(tmp_path, kind):
    """The refusal comes from the registry: every engine's node, under every other engine (and under auto once it
    resolves, `resolve_config`)."""
    settings = ENGINES[kind]
    field = dataclasses.fields(settings)[0]
    changed = {field.name: (field.default or 0) + 1 if not isinstance(field.default, str) else "x"}
    if kind == "vllm-server":
        changed = {"servers": 2}
    for other in ENGINES:
        if other == kind:
            continue
        with pytest.raises(ConfigError, match=rf"^rollout\.{settings.node()}\.{next(iter(changed))}: a setting of "
                                              rf"the {kind} engine"):
            smoke_config(tmp_path, rollout={"engine": other, "dtype": "float32", settings.node(): changed})


def test_bad_server_settings_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.servers: expected >= 1, got 0"):
        _cfg(tmp_path, servers=0)
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.urls: 'localhost:8000' is not a server URL"):
        _cfg(tmp_path, urls="localhost:8000")
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.servers: dppo starts servers only without"):
        _cfg(tmp_path, servers=2, urls="http://a:1")
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.timeout_s"):
        _cfg(tmp_path, timeout_s=0)
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.partial: expected one of keep, abort"):
        _cfg(tmp_path, partial="later")
    with pytest.raises(ConfigError, match=r"^rollout\.hf\.fp8_activations: a setting of the hf engine"):
        smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32", "quantization": "fp8",
                                        "hf": {"fp8_activations": True}})


def test_the_engine_spec_carries_the_server_settings_as_they_are(tmp_path):
    cfg = _cfg(tmp_path, urls="http://10.0.0.1:8000, http://10.0.0.2:8000", partial="abort",
               args="--max-num-seqs 8 --block-size 32", timeout_s=30, kv_cache_gb=0.5)
    spec = engine_spec(cfg, run_dir=tmp_path)
    assert spec.kind == "vllm-server" and spec.settings is cfg.rollout.vllm_server
    assert spec.settings == VLLMServerSettings(urls="http://10.0.0.1:8000, http://10.0.0.2:8000", partial="abort",
                                               args="--max-num-seqs 8 --block-size 32", timeout_s=30, kv_cache_gb=0.5)
    assert spec.settings.url_list == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert spec.settings.arg_list == ("--max-num-seqs", "8", "--block-size", "32")
    assert spec.log_dir == str(tmp_path / "servers") and spec.adapter is None and spec.versions_in_flight == 2
    assert engine_spec(_cfg(tmp_path)).log_dir is None


def test_adapter_sync_carries_the_adapter_and_the_versions_in_flight(tmp_path):
    cfg = smoke_config(tmp_path, model={"lora_rank": 4, "lora_alpha": 8.0},
                       rollout={"engine": "vllm-server", "dtype": "float32", "mode": "async", "max_staleness": 3,
                                "vllm_server": {"lora_sync": "adapter"}})
    spec = engine_spec(cfg)
    assert (spec.adapter.rank, spec.adapter.alpha, spec.versions_in_flight) == (4, 8.0, 5)
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.lora_sync: 'adapter' needs a LoRA run"):
        _cfg(tmp_path, lora_sync="adapter")


def test_only_the_chosen_engines_node_is_written_and_it_round_trips(tmp_path):
    cfg = _cfg(tmp_path, urls="http://127.0.0.1:8000", partial="abort")
    data = cfg.to_dict()
    assert "vllm_server" in data["rollout"] and "hf" not in data["rollout"] and "vllm" not in data["rollout"]
    cfg.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == cfg
