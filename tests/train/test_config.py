"""The run config (dppo.train.config): each engine's settings node and each episode kind's section refused under another
kind (naming the field and the kind that takes it) and carried as they are into the engine spec every rollout worker
builds its engine from; the recording proxy's section refused under a kind that plays through none; choosing a kind on
the command line; every preset resolved and round-tripped through config.yaml; an older config.yaml (and an older
flag) refused naming each moved field and its new place."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import smoke_config

import yaml

from dppo.cli import parse_config
from dppo.episodes.settings import EPISODE_KINDS, EnvSettings, ProxySettings
from dppo.rollout.settings import ENGINES, HFSettings, VLLMServerSettings
from dppo.train.rollout_build import engine_spec
from dppo.train.config import Config, ConfigError, replace
from dppo.train.presets import PRESETS, get_preset
from dppo.train.resolve import resolve_config


def _cfg(tmp_path, rollout=None, **server):
    return smoke_config(tmp_path, rollout={"engine": "vllm-server", "dtype": "float32", **(rollout or {}),
                                           "vllm_server": server})


@pytest.mark.parametrize("field, value", [("servers", 2), ("urls", "http://127.0.0.1:8000"), ("partial", "abort"),
                                          ("args", "--max-num-seqs 8"), ("weights_dir", "/tmp/w"),
                                          ("kv_cache_gb", 0.5)])
def test_server_settings_under_another_engine_are_refused_naming_the_engine(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"^rollout\.vllm_server\.{field}: a setting of the vllm-server engine, "
                                          rf"but the run's engines are 'hf'"):
        _cfg(tmp_path, rollout={"engine": "hf"}, **{field: value})


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_engine_node_is_refused_under_every_other_engine(tmp_path, kind):
    """The refusal comes from the registry: every engine's node, under every other engine (and under auto once it
    resolves, `resolve_config`)."""
    settings = ENGINES[kind]
    field = dataclasses.fields(settings)[0]  # a number in every engine's settings (max_batch_rows, kv_cache_gb, servers)
    changed = {field.name: field.default + 1}
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
    assert spec.kind == "vllm-server" and spec.settings is cfg.rollout.engines[0].settings
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


def test_the_engine_list_is_written_with_each_engines_own_settings_and_it_round_trips(tmp_path):
    cfg = _cfg(tmp_path, urls="http://127.0.0.1:8000", partial="abort")
    data = cfg.to_dict()
    assert not {"engine", "dtype", "fleet", "quantization", "hf", "vllm", "vllm_server"} & set(data["rollout"])
    assert data["rollout"]["engines"] == [{"kind": "vllm-server", "dtype": "float32", "fp8": False, "lag": 0,
                                           **dataclasses.asdict(VLLMServerSettings(urls="http://127.0.0.1:8000",
                                                                                   partial="abort"))}]
    cfg.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == cfg


CHANGED = {"env": ("max_tokens", 99), "agent": ("post_retries", 5), "verifiers": ("shuffle", False)}
"""A field of each episode kind's section and a value off its default."""


@pytest.mark.parametrize("kind", sorted(k for k, s in EPISODE_KINDS.items() if dataclasses.fields(s)))
def test_each_episode_kinds_section_is_refused_under_every_other_kind(tmp_path, kind):
    """The refusal comes from the registry: a changed field of a kind's section (the kinds with settings), under
    every other kind."""
    from conftest import smoke_config

    name, value = CHANGED[kind]
    for other in EPISODE_KINDS:
        if other != kind:
            with pytest.raises(ConfigError, match=rf"^{kind}\.{name}: a setting of the {kind} episodes, but the "
                                                  rf"run's episodes are '{other}' \(rollout\.episodes\)$"):
                smoke_config(tmp_path, rollout={"episodes": other}, **{kind: {name: value}})


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ProxySettings)])
def test_the_proxys_section_is_refused_under_a_kind_that_plays_through_none(tmp_path, field):
    """One `proxy` section for every kind that declares `uses_proxy` (agent, verifiers: their episodes get it as it
    is); a changed field of it under another kind is refused naming the field and the kinds that take it."""
    from conftest import smoke_config

    value = {"host": "0.0.0.0", "advertise_host": "10.0.0.1", "timeout_s": 5.0}.get(field, 7)
    users = [k for k, s in EPISODE_KINDS.items() if s.uses_proxy]
    assert users == ["agent", "verifiers"]
    for kind in EPISODE_KINDS:
        if kind in users:
            cfg = smoke_config(tmp_path, rollout={"episodes": kind, "max_new_tokens": 4}, proxy={field: value})
            assert getattr(cfg.proxy, field) == value
            continue
        with pytest.raises(ConfigError, match=rf"^proxy\.{field}: a setting of the recording proxy, which the run's "
                                              rf"episodes '{kind}' \(rollout\.episodes\) do not play through "
                                              rf"\(agent and verifiers do\)$"):
            smoke_config(tmp_path, rollout={"episodes": kind}, proxy={field: value})
    with pytest.raises(ConfigError, match=r"^command line: could not parse --proxy\.max-calls 3: proxy\.max_calls: a "
                                          r"setting of the recording proxy, which the run's episodes 'single'"):
        parse_config(["--preset", "smoke", "--proxy.max-calls", "3"], prog="dppo train")


def test_the_proxy_kinds_get_the_proxy_section_and_a_call_longer_than_a_row_is_refused_naming_it(tmp_path):
    from conftest import smoke_config
    from dppo.train.build import build_episodes

    cfg = smoke_config(tmp_path, rollout={"episodes": "agent", "max_new_tokens": 4},
                       agent={"name": "my_agent.py:solve"}, proxy={"max_calls": 3, "max_tokens": 50})
    assert build_episodes(cfg).settings is cfg.proxy and build_episodes(cfg).max_turns == 3
    with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens: 60 \(one call\) > proxy\.max_tokens 50 "
                                          r"\(a row\)$"):
        smoke_config(tmp_path, rollout={"episodes": "agent", "max_new_tokens": 60}, proxy={"max_tokens": 50})
    with pytest.raises(ConfigError, match=r"^proxy\.max_calls: expected >= 1, got 0$"):
        ProxySettings(max_calls=0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_and_its_config_yaml_round_trips(tmp_path, name):
    cfg = replace(get_preset(name), model={"device": "cpu"})
    resolved = resolve_config(cfg)
    resolved.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == resolved
    assert resolve_config(resolved) == resolved  # idempotent: a resumed run reads exactly it
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout"]
    assert [e["kind"] for e in written["engines"]] == [n.kind for n in resolved.rollout.engines]
    assert all(n.kind in ENGINES and n.dtype != "auto" for n in resolved.rollout.engines)  # no auto left


def test_choosing_a_kind_on_the_command_line_starts_from_its_defaults(tmp_path):
    cfg, _, _ = parse_config(["--preset", "calculator", "--rollout.episodes", "single"], prog="dppo eval")
    assert cfg.rollout.episodes == "single" and cfg.env == EnvSettings()
    agent = get_preset("calculator_agent")  # (its proxy: 3 calls of a 160-token row)
    cfg, _, _ = parse_config(["--preset", "calculator_agent", "--rollout.episodes", "env"], prog="dppo eval")
    assert cfg.proxy == ProxySettings() != agent.proxy  # env plays through no proxy: its settings went with agent
    cfg, _, _ = parse_config(["--preset", "calculator_agent", "--rollout.episodes", "verifiers"], prog="dppo eval")
    assert cfg.proxy == agent.proxy  # the proxy is the same for the kinds that play through it
    replace(get_preset("smoke"), rollout={"hf": {"max_batch_rows": 4}}).save(tmp_path / "hf.yaml")
    cfg, _, _ = parse_config(["--config", str(tmp_path / "hf.yaml"), "--rollout.engine", "vllm"], prog="dppo train")
    assert [n.kind for n in cfg.rollout.engines] == ["vllm"]  # the file's hf settings went with hf
    with pytest.raises(ConfigError, match=r"^command line: could not parse --rollout\.hf\.max-batch-rows 4 "
                                          r"--rollout\.engine vllm: rollout\.hf\.max_batch_rows: a setting of the hf "
                                          r"engine, but the run's engines are 'vllm'"):
        parse_config(["--preset", "smoke", "--rollout.hf.max-batch-rows", "4", "--rollout.engine", "vllm"],
                     prog="dppo train")  # a setting given for the engine not chosen: refused
    with pytest.raises(ConfigError, match=r"^command line: could not parse --env\.name feedback"):
        parse_config(["--preset", "smoke", "--env.name", "feedback"], prog="dppo train")  # no kind chosen: refused


def test_an_old_config_yaml_whose_episodes_were_chosen_by_a_name_is_refused_naming_the_new_choice(tmp_path):
    data = Config().to_dict()
    del data["rollout"]["episodes"], data["proxy"]
    data["agent"]["name"], data["env"]["max_tokens"] = "my_agent.py:solve", 120
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^agent\.name: .* was written by an older dppo; edit it: agent\.name "
                                          r"chooses nothing now: the episode kind is rollout\.episodes \(agent\); "
                                          r"env\.max_tokens \(an agent's row\) is now proxy\.max_tokens$"):
        Config.load(tmp_path / "config.yaml")


def test_an_old_config_yaml_and_old_flags_of_the_proxys_settings_are_refused_naming_the_proxy_section(tmp_path):
    """The recording proxy's settings were the agent and the verifiers sections' own (both): a run directory and the
    flags of an older dppo are refused naming each field's place in `proxy`."""
    data = Config().to_dict()
    del data["proxy"]
    data["agent"].update(max_calls=3, port=8100)
    data["verifiers"]["timeout_s"] = 300.0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^agent\.max_calls: .*config\.yaml was written by an older dppo; edit it: "
                                          r"agent\.max_calls is now proxy\.max_calls; agent\.port is now proxy\.port; "
                                          r"verifiers\.timeout_s is now proxy\.timeout_s$"):
        Config.load(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"^--agent\.max-calls: a flag of an older dppo; --agent\.max-calls is now "
                                          r"--proxy\.max-calls; --verifiers\.max-concurrent-requests is now "
                                          r"--proxy\.max-concurrent-requests$"):
        parse_config(["--preset", "smoke", "--rollout.episodes", "agent", "--agent.max-calls", "3",
                      "--verifiers.max-concurrent-requests=9"], prog="dppo train")


def test_a_setting_of_a_kind_beside_engine_auto_is_refused_naming_the_engine_to_choose(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_server\.servers: a setting of the vllm-server engine, but "
                                          r"rollout\.engine is auto: name the engine \(--rollout\.engine vllm-server\)"):
        _cfg(tmp_path, rollout={"engine": "auto"}, servers=2)  # auto never chooses vllm-server


def test_an_engine_that_records_no_top_k_is_refused_for_a_top_k_trust_region(tmp_path, monkeypatch):
    from conftest import smoke_config

    monkeypatch.setattr(HFSettings, "can_record_top_k", False)  # what the engine declares is what is checked
    smoke_config(tmp_path, rollout={"engine": "hf"})  # no top-K needed: fine
    with pytest.raises(ConfigError, match=r"^rollout\.top_k_logprobs: the hf engine does not record µ's top-K"):
        smoke_config(tmp_path, rollout={"engine": "hf"}, loss={"trust_region": "dppo_topk_tv"})


@pytest.mark.parametrize("key, option", [("eval_size", 20), ("size", 50), ("seed", 3)])
def test_a_task_option_that_differs_from_the_task_sections_field_is_refused_naming_both(tmp_path, key, option):
    """`{"eval_size": 20}` in task.options beside the preset's task.eval_size 16 silently gave 16: now refused, naming
    the flag that sets it; the same value in both places is accepted."""
    import json

    given = getattr(get_preset("smoke").task, key)
    with pytest.raises(ConfigError, match=rf"^task\.options: {key} {option} here and task\.{key} {given}: give it once, "
                                          rf"as task\.{key} \(--task\.{key.replace('_', '-')} {option}\)"):
        smoke_config(tmp_path, task={"options": json.dumps({"digits": 1, key: option})})
    smoke_config(tmp_path, task={"options": json.dumps({"digits": 1, key: given})})


def test_a_flag_of_an_older_dppo_is_refused_naming_its_new_flag_and_a_refusals_reason_ends_the_line():
    """`--rollout.server-urls` (moved to the vllm-server node) gets the same "X is now Y" as an old config.yaml, not
    the parser's "could not parse"; a refusal from a field's check says its reason on the error line itself."""
    with pytest.raises(ConfigError, match=r"^--rollout\.server-urls: a flag of an older dppo; --rollout\.server-urls is "
                                          r"now --rollout\.vllm-server\.urls; --model\.autocast-bf16 is now "
                                          r"--model\.precision \(true: bf16, false: fp32\)$"):
        parse_config(["--preset", "smoke", "--rollout.server-urls=http://127.0.0.1:1", "--model.autocast-bf16"],
                     prog="dppo train")
    with pytest.raises(ConfigError, match=r"could not parse --agent\.name a\.py:f: agent\.name: a setting of the "
                                          r"agent episodes, but the run's episodes are 'single' \(rollout\.episodes\)"):
        parse_config(["--preset", "smoke", "--agent.name", "a.py:f"], prog="dppo train")
    with pytest.raises(ConfigError, match=r"could not parse --rollout\.vllm-server-urls x: Unrecognized options: "
                                          r"--rollout\.vllm-server-urls, x; perhaps you meant --rollout\.vllm-server\.urls"):
        parse_config(["--preset", "smoke", "--rollout.vllm-server-urls", "x"], prog="dppo train")
