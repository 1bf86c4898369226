"""The vllm-server engine's settings: refused before anything starts when they cannot apply (naming the field), and
carried into the engine spec every rollout worker builds its engine from."""

from __future__ import annotations

import pytest
from conftest import smoke_config

from dppo.train.build import engine_spec
from dppo.train.config import ConfigError


def _cfg(tmp_path, **rollout):
    return smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32", **rollout})


@pytest.mark.parametrize("field, value", [("servers", 2), ("server_urls", "http://127.0.0.1:8000"),
                                          ("server_partial", "abort"), ("server_args", "--max-num-seqs 8"),
                                          ("server_weights_dir", "/tmp/w")])
def test_server_settings_need_the_server_engine(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"^rollout\.{field}: needs rollout\.engine vllm-server"):
        _cfg(tmp_path, engine="hf", **{field: value})


def test_bad_server_settings_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.servers: expected >= 1, got 0"):
        _cfg(tmp_path, servers=0)
    with pytest.raises(ConfigError, match=r"^rollout\.server_urls: 'localhost:8000' is not a server URL"):
        _cfg(tmp_path, server_urls="localhost:8000")
    with pytest.raises(ConfigError, match=r"^rollout\.servers: dppo starts servers only without"):
        _cfg(tmp_path, servers=2, server_urls="http://a:1")
    with pytest.raises(ConfigError, match=r"^rollout\.server_timeout_s"):
        _cfg(tmp_path, server_timeout_s=0)
    with pytest.raises(ConfigError, match=r"^rollout\.fp8_activations: needs the hf engine"):
        _cfg(tmp_path, quantization="fp8", fp8_activations=True)


def test_the_engine_spec_carries_the_server_settings(tmp_path):
    cfg = _cfg(tmp_path, server_urls="http://10.0.0.1:8000, http://10.0.0.2:8000", server_partial="abort",
               server_args="--max-num-seqs 8 --block-size 32", server_timeout_s=30, vllm_kv_cache_gb=0.5)
    spec = engine_spec(cfg, run_dir=tmp_path)
    assert spec.kind == "vllm-server"
    assert spec.vllm == {"urls": ("http://10.0.0.1:8000", "http://10.0.0.2:8000"), "servers": 1, "partial": "abort",
                         "timeout_s": 30.0, "start_timeout_s": 30.0, "weights_dir": None, "kv_cache_gb": 0.5,
                         "server_args": ("--max-num-seqs", "8", "--block-size", "32"),
                         "log_dir": str(tmp_path / "servers")}
    assert engine_spec(_cfg(tmp_path)).vllm["log_dir"] is None
