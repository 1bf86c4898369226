"""Hardware-aware precision and engine (`dppo.runtime.hardware`), with faked CPU flags and CUDA capabilities; the registry's
trust-region parameters as config fields and CLI flags; the options that were unreachable before."""

from __future__ import annotations

import pytest
import torch

from dppo.runtime import hardware
from dppo.train.config import Config, ConfigError, replace
from dppo.train.presets import get_preset
from dppo.trust_region import DEFAULT_TOP_K, TRUST_REGIONS, all_params
from conftest import smoke_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})  # e.g. the AMD EPYC of machine-facts, most laptops
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16"}  # Zen 4, Cooper Lake
SAPPHIRE = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}  # Intel AMX
ARM_BF16 = frozenset({"fp", "asimd", "sve", "bf16"})  # Neoverse V1 /proc/cpuinfo "Features"


@pytest.mark.parametrize("flags, native", [(AVX2, False), (AVX512_BF16, True), (SAPPHIRE, True), (ARM_BF16, True),
                                           (frozenset(), False)])
def test_auto_dtype_follows_native_bf16_on_cpu(flags, native):
    choice, warning = hardware.resolve_dtype("auto", CPU, flags=flags)
    assert choice.value == ("bfloat16" if native else "float32") and warning is None
    assert ("no native bf16" in choice.reason) != native


@pytest.mark.parametrize("env, native", [("avx2 fma", False), ("avx2 avx512_bf16", True), ("", False)])
def test_dppo_cpu_flags_simulates_another_cpu(monkeypatch, env, native):
    """DPPO_CPU_FLAGS replaces /proc/cpuinfo's flags, so `auto` chooses as on that CPU (the suite runs both ways)."""
    monkeypatch.setenv("DPPO_CPU_FLAGS", env)
    hardware.cpu_flags.cache_clear()
    try:
        assert hardware.cpu_flags() == frozenset(env.split())
        assert hardware.resolve_dtype("auto", CPU)[0].value == ("bfloat16" if native else "float32")
    finally:
        monkeypatch.delenv("DPPO_CPU_FLAGS")
        hardware.cpu_flags.cache_clear()


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cuda_follows_the_device(bf16, expected):
    assert hardware.resolve_dtype("auto", CUDA, cuda_bf16=bf16)[0].value == expected


def test_explicit_bf16_without_native_support_runs_with_a_warning():
    choice, warning = hardware.resolve_dtype("bfloat16", CPU, flags=AVX2)
    assert choice.value == "bfloat16"
    assert "3-4x slower than float32" in warning and "no native bf16" in warning
    assert hardware.resolve_dtype("bfloat16", CPU, flags=AVX512_BF16)[1] is None
    assert hardware.resolve_dtype("float32", CPU, flags=AVX2) == (hardware.Choice("float32", "as configured"), None)


@pytest.mark.parametrize("device, dtype, has_vllm, expected", [
    (CPU, "float32", True, "hf"), (CPU, "bfloat16", True, "vllm"), (CUDA, "bfloat16", True, "vllm"),
    (CUDA, "float32", True, "vllm"), (CPU, "bfloat16", False, "hf"), (CUDA, "bfloat16", False, "hf")])
def test_auto_engine_rule(device, dtype, has_vllm, expected):
    assert hardware.resolve_engine("auto", dtype, device, has_vllm=has_vllm).value == expected
    assert hardware.resolve_engine("vllm", dtype, device, has_vllm=has_vllm).value == "vllm"  # explicit wins


def test_this_machine_is_described():
    import torch

    from dppo.train.resolve import resolve_node

    cfg = replace(get_preset("demo"), model={"device": "cpu"})
    engine, dtype, _ = resolve_node(cfg.rollout.engines[0], torch.device("cpu"))
    native = any(f in hardware.cpu_flags() for f in hardware.BF16_CPU_FLAGS)
    assert dtype.value == ("bfloat16" if native else "float32")
    line = hardware.describe(engine, dtype)
    assert line.startswith(f"[dppo] engine {engine.value} (") and f"engine dtype {dtype.value} (" in line


def test_the_trainer_announces_its_choice(tmp_path, capsys):
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, model={"device": "cpu"}, rollout={"engine": "hf", "dtype": "auto"})
    trainer = Trainer(cfg, tmp_path)
    engine_dtype = next(trainer.engine.model.parameters()).dtype
    trainer.close()
    out = capsys.readouterr().out
    native = any(f in hardware.cpu_flags() for f in hardware.BF16_CPU_FLAGS)
    assert f"engine dtype {'bfloat16' if native else 'float32'} (this CPU has" in out
    assert engine_dtype == (torch.bfloat16 if native else torch.float32)


# ---------------------------------------------------------------------------------------------- config fields
def test_every_trust_region_parameter_is_a_config_field_and_a_flag(capsys):
    from dppo.cli import parse_config

    names = set(all_params())
    assert {"cppo_w_min", "cppo_delta_b_min", "cppo_q", "cppo_k", "neg_delta", "relax_alpha"} <= names
    assert names <= set(Config().loss.settings())
    flags = ["--loss.trust-region", "cppo", "--loss.cppo-w-min", "0.5", "--loss.cppo-delta-b-min", "0.03",
             "--loss.cppo-q", "0.8", "--loss.cppo-k", "2"]
    cfg, _, _ = parse_config(["--preset", "smoke", *flags], prog="dppo train")
    assert (cfg.loss.cppo_w_min, cfg.loss.cppo_delta_b_min, cfg.loss.cppo_q, cfg.loss.cppo_k) == (0.5, 0.03, 0.8, 2.0)
    cfg, _, _ = parse_config(["--preset", "smoke", "--loss.trust-region", "pg_is_neg_mask", "--loss.neg-delta", "0.8"],
                             prog="dppo train")
    assert cfg.loss.neg_delta == 0.8
    with pytest.raises(ConfigError, match=r"^loss\.cppo_q: expected in \[0, 1\], got 1\.5"):
        replace(get_preset("smoke"), loss={"trust_region": "cppo", "cppo_q": 1.5})
    with pytest.raises(ConfigError, match=r"^loss\.neg_delta: expected > 0"):
        replace(get_preset("smoke"), loss={"trust_region": "pg_is_neg_mask", "neg_delta": -1.0})
    with pytest.raises(ConfigError, match=r"^loss\.neg_delta: not a parameter of trust region 'dppo_binary_tv'.*; "
                                          r"it is taken by pg_is_neg_mask$"):  # another region's: refused
        replace(get_preset("smoke"), loss={"neg_delta": 0.8})


def test_a_saved_config_with_region_parameters_round_trips(tmp_path):
    cfg = replace(get_preset("smoke"), loss={"trust_region": "cppo", "cppo_k": 1.5})
    cfg.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == cfg


def test_top_k_defaults_to_20_only_where_a_trust_region_needs_it():
    assert get_preset("demo").top_k_logprobs == 0
    for name, region in TRUST_REGIONS.items():
        required = {"relax_alpha": 0.1} if "relax_alpha" in region.params else {}  # ppo_clip_relax's, no default
        cfg = replace(get_preset("demo"), loss={"trust_region": name, **required})
        assert cfg.top_k_logprobs == (DEFAULT_TOP_K if region.needs_topk else 0)
    assert replace(get_preset("demo"), rollout={"top_k_logprobs": 5}).top_k_logprobs == 5
    with pytest.raises(ConfigError, match=r"^rollout\.top_k_logprobs: trust region 'dppo_topk_kl' needs"):
        replace(get_preset("demo"), loss={"trust_region": "dppo_topk_kl"}, rollout={"top_k_logprobs": 0})


def test_hf_max_batch_rows_reaches_the_engine(tmp_path):
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"hf": {"max_batch_rows": 4}})
    trainer = Trainer(cfg, tmp_path)
    assert trainer.engine.max_batch_rows == 4
    trainer.close()
    with pytest.raises(ConfigError, match=r"^rollout\.hf\.max_batch_rows: expected >= 0"):
        replace(get_preset("smoke"), rollout={"hf": {"max_batch_rows": -1}})


def test_gradient_checkpointing_picks_the_packed_layout_and_refuses_shared():
    from dppo.train.build import scoring_layout

    cfg = replace(get_preset("smoke"), model={"gradient_checkpointing": True})
    assert scoring_layout(cfg, sharded=True) == scoring_layout(cfg, sharded=False) == "packed"
    assert scoring_layout(get_preset("smoke"), sharded=True) == "shared"
    with pytest.raises(ConfigError, match=r"^train\.scoring_layout: 'shared' needs the prompts' KV cache"):
        replace(cfg, train={"scoring_layout": "shared"})


def test_a_config_written_before_the_registry_fields_loads_once_its_moved_fields_are_moved(tmp_path):
    # tests/data/config_before_registry.yaml: the dppo-topk-kl preset as the code before the trust-region registry
    # carried its parameters (and before rollout.dtype/engine auto, and before each engine's settings moved to its
    # node) wrote it to a run's config.yaml: refused naming each moved field and its new place; moved, it loads.
    from pathlib import Path

    import yaml

    old = Path(__file__).resolve().parents[1] / "data" / "config_before_registry.yaml"
    with pytest.raises(ConfigError, match=r"^model\.autocast_bf16: .*config_before_registry.yaml was written by an "
                                          r"older dppo; edit it: model\.autocast_bf16 is now model\.precision .*; "
                                          r"rollout\.vllm_kv_cache_gb is now rollout\.vllm\.kv_cache_gb .*; "
                                          r"rollout\.vllm_gpu_memory_utilization is now "
                                          r"rollout\.vllm\.gpu_memory_utilization; rollout\.engine, rollout\.dtype are "
                                          r"now rollout\.engines, a list of engines: engines: \[\{kind: auto, dtype: "
                                          r"bfloat16, fp8: False, lag: 0\}\]$"):
        Config.load(old)
    data = yaml.safe_load(old.read_text())
    data["model"]["precision"] = "bf16" if data["model"].pop("autocast_bf16") else "fp32"
    for name in ("vllm_kv_cache_gb", "vllm_gpu_memory_utilization"):  # (their defaults: an engine auto takes none)
        data["rollout"].pop(name)
    data["rollout"]["engines"] = [{"kind": data["rollout"].pop("engine"), "dtype": data["rollout"].pop("dtype")}]
    hidden, layers = data["model"].pop("tiny_hidden"), data["model"].pop("tiny_layers")  # (unused: not tiny-random)
    data["optim"]["betas"] = [data["optim"].pop("beta1"), data["optim"].pop("beta2")]
    data["log"]["report_to"] = ["tensorboard"] if data["log"].pop("tensorboard") else ["none"]
    del data["advantage"]["eps"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    # relax_side (then a field of every config, default both) is a parameter only ppo_clip_relax takes
    with pytest.raises(ConfigError, match=r"^loss\.relax_side: not a parameter of trust region 'dppo_topk_kl' "
                                          r"\(which takes delta_low, delta_high\); it is taken by ppo_clip_relax$"):
        Config.load(tmp_path / "config.yaml")
    del data["loss"]["relax_side"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    cfg = Config.load(tmp_path / "config.yaml")
    assert cfg.loss.trust_region == "dppo_topk_kl" and cfg.loss.relax_side is None and cfg.loss.cppo_q is None
    assert cfg.rollout.engines[0].dtype == "bfloat16" and cfg.top_k_logprobs == 20
    assert cfg.train.scoring_layout == "auto" and cfg.rollout.engines[0].settings is None  # (auto: resolved at start)
