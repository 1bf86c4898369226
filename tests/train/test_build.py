"""dppo.train.build: the run config turned into the parts the trainer uses — the resolved config and the engine spec."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import yaml

from dppo.cli import parse_config

from dppo.rollout.spec import EngineSpec, build_engine
from dppo.runtime.models import tiny_dims
from dppo.train.rollout_build import engine_spec
from dppo.train.resolve import resolve_config
from dppo.train.config import Config, ConfigError, replace
from dppo.train.presets import get_preset
from dppo.trust_region import DEFAULT_TOP_K, TRUST_REGIONS


@pytest.mark.parametrize("region", sorted(TRUST_REGIONS))
def test_the_resolved_config_names_every_value_the_run_uses(region, tmp_path):
    extra = {"relax_alpha": 0.1} if region == "ppo_clip_relax" else {}
    cfg = replace(get_preset("smoke"), loss={"trust_region": region, **extra}, model={"device": "cpu"})
    resolved = resolve_config(cfg)
    (node,) = resolved.rollout.engines
    assert node.kind in ("hf", "vllm") and node.dtype in ("float32", "bfloat16")
    assert resolved.rollout.top_k_logprobs == (DEFAULT_TOP_K if TRUST_REGIONS[region].needs_topk else 0)
    for name, param in TRUST_REGIONS[region].params.items():  # each parameter at its registry default (or as given)
        assert getattr(resolved.loss, name) == extra.get(name, param.default), name
    assert resolve_config(resolved) == resolved  # idempotent: a resumed run resolves to the same values
    resolved.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == resolved  # what the run directory holds is what a resume reads


@pytest.mark.parametrize("loss, sequence_delta", [({}, math.inf), ({"sequence_mask": "mean_k3"}, 0.1),
                                                   ({"sequence_mask": "max_divergence", "sequence_delta": 0.3}, 0.3),
                                                   ({"loss": "drpo"}, math.inf)])
def test_the_resolved_loss_leaves_no_default_unset(loss, sequence_delta, tmp_path):
    """config.yaml records the sequence mask's δ (∞ for "none": no unit is dropped) and DRPO's δ as the run uses
    them (`LossConfig.spec`), and the file reads back to the same spec."""
    cfg = replace(get_preset("smoke"), loss=loss, rollout={"engine": "hf", "dtype": "float32"})
    resolved = resolve_config(cfg)
    assert resolved.loss.sequence_delta == sequence_delta and resolved.loss.drpo_delta == 0.15
    assert resolved.loss.spec() == cfg.loss.spec()  # resolving writes out the values; it changes none
    resolved.save(tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    loss_part = text[text.index("loss:"):text.index("advantage:")]
    for name in ("sequence_delta", "drpo_delta", "delta_low", "delta_high"):
        assert f"{name}: null" not in loss_part, name
    assert Config.load(tmp_path / "config.yaml").loss.spec() == cfg.loss.spec()


def test_given_values_survive_resolution():
    cfg = replace(get_preset("smoke"), loss={"trust_region": "dppo_topk_tv", "delta_low": 0.07},
                  rollout={"top_k_logprobs": 5, "engine": "hf", "dtype": "float32"})
    resolved = resolve_config(cfg)
    assert (resolved.loss.delta_low, resolved.loss.delta_high) == (0.07, 0.15)
    (node,) = resolved.rollout.engines
    assert (resolved.rollout.top_k_logprobs, node.kind, node.dtype) == (5, "hf", "float32")


def test_the_engine_spec_is_picklable_and_builds_the_run_model():
    cfg = replace(get_preset("smoke"), rollout={"engine": "hf", "dtype": "float32"}, model={"device": "cpu"})
    spec = engine_spec(cfg, seed_offset=3)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert (spec.kind, spec.dtype, spec.seed, spec.model.name) == ("hf", "float32", cfg.train.seed + 3, "tiny-random")
    engine = build_engine(spec)
    try:
        assert (engine.model.config.hidden_size, engine.model.config.num_hidden_layers) == tiny_dims(cfg.model.name)
    finally:
        engine.close()


def test_a_k_above_the_engine_cap_is_refused_at_build_time_naming_the_field():
    spec = engine_spec(replace(get_preset("smoke"), rollout={"engine": "hf", "dtype": "float32"}, model={"device": "cpu"}))
    with pytest.raises(ValueError, match=r"^rollout\.top_k_logprobs: 100000 exceeds the hf engine's max_logprobs"):
        build_engine(dataclasses.replace(spec, top_k_logprobs=100_000))
    with pytest.raises(ValueError, match=r"^rollout\.dtype:"):
        EngineSpec(spec.model, dtype="float8")


def _file_config(tmp_path, eval_size, **options):
    import json

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(40)))
    return replace(get_preset("smoke"), task={"name": "file", "options": json.dumps({"path": str(data), **options}),
                                              "eval_size": eval_size})


@pytest.mark.parametrize("kind", ["generated", "file", "file-eval-path"])
@pytest.mark.parametrize("eval_size", [0, 3])
def test_eval_size_is_honoured_for_every_task_kind(kind, eval_size, tmp_path):
    """task.eval_size held-out questions for every kind of task: a generated task makes that many, a file task is
    evaluated on its first eval_size held-out rows (0: none), which stay out of training either way."""
    from dppo.train.build import build_task

    if kind == "generated":
        cfg = replace(get_preset("smoke"), task={"eval_size": eval_size})
    elif kind == "file":
        cfg = _file_config(tmp_path, eval_size, eval_fraction=0.25)  # 10 held-out rows
    else:
        held = tmp_path / "held.jsonl"
        held.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(8)))
        cfg = _file_config(tmp_path, eval_size, eval_path=str(held))
    task = build_task(cfg)
    assert len(task.eval) == eval_size
    if kind != "generated":
        assert len(task.train) == (30 if kind == "file" else 32)  # the held-out rows never train
    assert not {ex.uid for ex in task.train} & {ex.uid for ex in task.eval}


def test_eval_with_eval_size_0_is_refused_naming_the_field(tmp_path):
    from dppo.train.evaluation import evaluate_checkpoint

    with pytest.raises(ValueError, match=r"^task.eval_size: 'file' has no held-out questions"):
        evaluate_checkpoint(_file_config(tmp_path, 0), None)


def test_with_an_environment_the_task_reward_is_not_used_and_the_run_says_so():
    """The environment scores each episode (the sum of its turns' rewards): a task.reward beside it (the smoke
    preset's digit_fraction) is recorded as '' in the resolved config, and the start-up notes name it."""
    from dppo.train.resolve import resolution_notes

    cfg = replace(get_preset("smoke"), rollout={"episodes": "env"}, env={"name": "feedback"})
    assert cfg.task.reward == "digit_fraction" and resolve_config(cfg).task.reward == ""
    assert resolution_notes(cfg) == ["[dppo] task.reward 'digit_fraction' is not used: environment 'feedback' scores "
                                     "each episode (config.yaml records reward '')"]
    single = get_preset("smoke")
    assert resolve_config(single).task.reward == "digit_fraction" and resolution_notes(single) == []


def test_a_tiny_random_name_carries_its_size_and_the_fields_it_replaced_are_refused(tmp_path):
    from dppo.train.build import model_spec

    spec = model_spec(replace(get_preset("smoke"), model={"name": "tiny-random-96x3"}))
    assert (spec.name, spec.tiny_hidden, spec.tiny_layers) == ("tiny-random", 96, 3)
    assert (model_spec(get_preset("smoke")).tiny_hidden, model_spec(get_preset("smoke")).tiny_layers) == (64, 2)
    with pytest.raises(ConfigError, match=r"^model\.name: 'tiny-random-100x2': tiny-random-HxL needs H a positive "
                                          r"multiple of 32"):
        replace(get_preset("smoke"), model={"name": "tiny-random-100x2"})
    data = get_preset("smoke").to_dict()
    data["model"]["tiny_hidden"], data["optim"]["beta1"], data["advantage"]["eps"] = 96, 0.8, 1e-4
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"edit it: model\.tiny_hidden is now model\.name \(tiny-random-HxL: .*\); "
                                          r"optim\.beta1 is now optim\.betas \(β1 β2\); advantage\.eps is gone: a "
                                          r"standard deviation is divided with dppo\.advantages\.STD_EPS \(1e-6\) added"):
        Config.load(tmp_path / "config.yaml")
    cfg, _, _ = parse_config(["--preset", "smoke", "--optim.betas", "0.9", "0.95"], prog="dppo train")
    assert cfg.optim.betas == (0.9, 0.95)
