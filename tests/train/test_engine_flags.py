"""The command line's spellings of rollout.engines (`dppo.train.engine_flags`): the fleet member grammar, flags that
read back into the list they were written from, a config file's engines with settings of their own (two vllm-server
engines on their own URLs) kept under the flags, a kind's flag applied to every engine of that kind, per-engine lags,
and an older config.yaml's engine fields refused with the list they spell."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import smoke_config

from dppo.cli import parse_config
from dppo.rollout.settings import EngineNode, HFSettings, VLLMServerSettings
from dppo.train.config import Config, ConfigError, RolloutConfig, replace
from dppo.train.engine_flags import engines_of, from_flags, parse_members, to_flags

TWO_SERVERS = (EngineNode("vllm-server", "float32", settings=VLLMServerSettings(urls="http://127.0.0.1:8101")),
               EngineNode("vllm-server", "float32", settings=VLLMServerSettings(urls="http://127.0.0.1:8102")))


def test_fleet_members_parse_and_malformed_ones_are_refused_naming_rollout_fleet():
    assert parse_members(" vllm-server:bfloat16, hf:float32:fp8") == [("vllm-server", "bfloat16", False),
                                                                     ("hf", "float32", True)]
    for bad, match in (("hf,hf:float32", "not KIND:DTYPE"), ("hf:float32:int4", "not KIND:DTYPE"),
                       ("sglang:float32,hf:float32", "unknown engine 'sglang'"), ("hf:float64", "unknown dtype")):
        with pytest.raises(ConfigError, match=rf"^rollout\.fleet: .*{match}"):
            parse_members(bad)


@pytest.mark.parametrize("engines", [
    (EngineNode(),),
    (EngineNode("hf", "bfloat16", fp8=True, lag=2, settings=HFSettings(max_batch_rows=3)),),
    (EngineNode("hf", "float32"), EngineNode("hf", "bfloat16", lag=1), EngineNode("vllm-server", "bfloat16")),
    TWO_SERVERS,
])
def test_flags_written_from_a_list_read_back_into_the_same_list(engines):
    rollout = RolloutConfig(engines=engines)
    assert from_flags(to_flags(rollout), rollout.engines) == rollout


def test_a_config_files_two_servers_on_their_own_urls_stay_two_under_the_flags(tmp_path):
    cfg = replace(smoke_config(tmp_path), rollout={"engines": TWO_SERVERS})
    cfg.save(tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout"]["engines"]
    assert [e["urls"] for e in written] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    again, _, _ = parse_config(["--config", str(tmp_path / "config.yaml"), "--rollout.vllm-server.timeout-s", "30",
                                "--train.steps", "2"], prog="dppo train")
    assert [n.settings for n in again.rollout.engines] == [dataclasses.replace(n.settings, timeout_s=30.0)
                                                          for n in TWO_SERVERS]  # every server engine, URLs kept
    one, _, _ = parse_config(["--config", str(tmp_path / "config.yaml"), "--rollout.engine", "hf"], prog="dppo train")
    assert one.rollout.engines == (EngineNode("hf"),)  # an engine named: one engine, from hf's defaults (dtype auto)


def test_the_same_server_twice_is_refused_naming_the_engine():
    with pytest.raises(ConfigError, match=r"^rollout\.engines\[1\]: engines 0 and 1 would share the server "
                                          r"http://127\.0\.0\.1:8101"):
        RolloutConfig(engines=(TWO_SERVERS[0], TWO_SERVERS[0]))


def test_lags_are_each_engines_and_the_lag_flag_sets_them_all(tmp_path):
    cfg = replace(smoke_config(tmp_path), rollout={"fleet": "hf:float32,hf:float32"})
    lagged = replace(cfg, rollout={"engines": (cfg.rollout.engines[0], dataclasses.replace(cfg.rollout.engines[1], lag=2))})
    assert lagged.rollout.max_lag == 2 and [n.lag for n in lagged.rollout.engines] == [0, 2]
    flags = to_flags(lagged.rollout)
    assert flags.engine_lag is None  # (they differ)
    assert engines_of(flags, lagged.rollout.engines) == lagged.rollout.engines
    assert [n.lag for n in replace(lagged, rollout={"engine_lag": 1}).rollout.engines] == [1, 1]
    with pytest.raises(ConfigError, match=r"^rollout\.engine_lag: expected >= 0, got -3"):
        replace(cfg, rollout={"engine_lag": -3})


def test_an_older_config_yamls_engine_fields_are_refused_with_the_list_they_spell(tmp_path):
    data = Config().to_dict()
    del data["rollout"]["engines"]
    data["rollout"].update(engine="hf", dtype="bfloat16", quantization="fp8", engine_lag=1,
                           hf={"max_batch_rows": 4, "fp8_activations": False})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"was written by an older dppo; edit it: rollout\.engine, rollout\.dtype, "
                                          r"rollout\.quantization, rollout\.engine_lag, rollout\.hf are now "
                                          r"rollout\.engines, a list of engines: engines: \[\{kind: hf, dtype: "
                                          r"bfloat16, fp8: True, lag: 1, max_batch_rows: 4, fp8_activations: False\}\]"):
        Config.load(tmp_path / "config.yaml")


def test_a_config_files_malformed_engine_is_refused_naming_its_place(tmp_path):
    data = Config().to_dict()
    data["rollout"]["engines"] = [{"kind": "hf", "dtype": "float32"}, {"kind": "hf", "max_batch_rowz": 2}]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^rollout\.engines\[1\]\.max_batch_rowz: unknown field of a hf engine; "
                                          r"valid: kind, dtype, fp8, lag, fp8_activations, max_batch_rows"):
        Config.load(tmp_path / "config.yaml")
    data["rollout"]["engines"] = []
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^rollout\.engines: expected a list of one or more engines"):
        Config.load(tmp_path / "config.yaml")
