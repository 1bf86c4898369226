"""End-to-end trainer tests on the tiny random model: smoke run, every trust region, resume, bad input."""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dppo.cli import main
from dppo.train.config import Config, ConfigError, replace
from dppo.runtime.models import char_tokenizer, tiny_dims, tiny_random_model
from dppo.train.presets import get_preset
from dppo.train.trainer import Trainer
from dppo.trust_region import TRUST_REGIONS
from conftest import smoke_config

REWARD_SRC = '''
def digit_fraction(completion, example):
    """Shaped reward with signal even for a random model: the fraction of digit characters."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(REWARD_SRC)
    return f"{path}:digit_fraction"


def _smoke(tmp_path, reward_file, **sections):
    cfg = smoke_config(tmp_path, task={"reward": reward_file}, train={"steps": 2})
    return replace(cfg, **sections) if sections else cfg


REQUIRED_KEYS = {"step", "reward/mean", "trust_region/masked_frac", "mismatch/binary_tv_mean", "perf/tokens_per_s",
                 "optim/grad_norm", "policy/entropy", "advantage/zero_group_frac", "perf/generation_s", "perf/training_s",
                 "perf/forward_s", "perf/backward_s", "perf/optimizer_s", "perf/loss_s", "perf/metrics_s", "perf/sync_s"}


def test_smoke_preset_end_to_end_and_resume(tmp_path, reward_file):
    run = tmp_path / "run"
    rc = main(["train", "--preset", "smoke", "--run-dir", str(run), "--task.reward", reward_file, "--log.no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["optim/grad_norm"])
    assert any(r["optim/grad_norm"] > 0 for r in rows)
    for r in rows:  # the time breakdown: phases are disjoint parts of the step, the update's parts of `training`
        parts = [r[f"perf/{k}_s"] for k in ("forward", "loss", "backward", "optimizer")]
        assert all(p > 0 for p in parts) and sum(parts) <= r["perf/training_s"]
        phases = [r[f"perf/{k}_s"] for k in ("generation", "reward", "recompute", "training", "sync", "metrics")]
        assert sum(phases) <= r["perf/step_s"] and sum(phases) >= 0.5 * r["perf/step_s"]
    assert rows[0]["perf/log_write_prev_s"] == 0 and rows[1]["perf/log_write_prev_s"] > 0
    # every trained parameter changed from its seeded initialisation
    cfg = get_preset("smoke")
    hidden, layers = tiny_dims(cfg.model.name)
    heads = hidden // 32
    init = tiny_random_model(char_tokenizer(), hidden_size=hidden, num_layers=layers,
                             num_heads=heads, num_kv_heads=heads, seed=cfg.train.seed)
    saved = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    init_params = dict(init.named_parameters())
    assert set(saved) == set(init_params)
    unchanged = [n for n, p in init_params.items() if torch.equal(p.detach(), saved[n])]
    assert not unchanged, f"parameters never updated: {unchanged}"
    assert (run / "config.yaml").is_file() and (run / "curves.png").stat().st_size > 1000
    saved_cfg = Config.load(run / "config.yaml")  # resolved: the δ's, K, engine and dtype the run used
    assert (saved_cfg.loss.delta_low, saved_cfg.loss.delta_high, saved_cfg.rollout.top_k_logprobs) == (0.15, 0.15, 0)
    (node,) = saved_cfg.rollout.engines
    assert node.kind in ("hf", "vllm") and node.dtype in ("float32", "bfloat16")
    assert (run / "samples.jsonl").read_text().strip() and (run / "eval.jsonl").read_text().strip()
    assert list((run / "tb").iterdir())
    # resume: continues at step 4 with the run's own config, up to the new step count
    rc = main(["train", "--resume", str(run), "--train.steps", "5", "--log.no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert (run / "checkpoints" / "step_000005" / "COMPLETE").is_file()


CASES = [pytest.param({"trust_region": name, **({"relax_alpha": 0.1} if name == "ppo_clip_relax" else {})}, id=name)
         for name in TRUST_REGIONS]
CASES += [pytest.param({"trust_region": "dppo_binary_tv", "anchor": "recompute"}, id="dppo-recompute"),
          pytest.param({"trust_region": "dppo_topk_kl", "anchor": "recompute"}, id="topk-kl-recompute"),
          pytest.param({"trust_region": "ppo_clip", "anchor": "recompute"}, id="minirl"),
          pytest.param({"loss": "drpo"}, id="drpo"),
          pytest.param({"trust_region": "none", "is_cap": math.inf}, id="pg-is")]


@pytest.mark.parametrize("loss", CASES)
def test_each_trust_region_runs_two_steps(tmp_path, reward_file, loss):
    rollout = {"top_k_logprobs": 5} if "topk" in loss.get("trust_region", "") else {}
    cfg = _smoke(tmp_path, reward_file, loss=loss, **({"rollout": rollout} if rollout else {}))
    trainer = Trainer(cfg, tmp_path)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        m1, m2 = trainer.step(), trainer.step()
    finally:
        trainer.close()
    for m in (m1, m2):
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    if rollout:
        assert "mismatch/topk_tv_mean" in m1
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"loss": {"trust_region": "dppo_topk_tv"}, "rollout": {"top_k_logprobs": 0}}, "rollout.top_k_logprobs"),
        ({"train": {"mini_batches": 3}}, "train.mini_batches"),
        ({"train": {"mini_batches": 8}}, "train.mini_batches"),
        ({"rollout": {"group_size": 1}}, "rollout.group_size"),
        ({"loss": {"trust_region": "nope"}}, "loss.trust_region"),
        ({"loss": {"delta_high": 0.0}}, "loss.delta_high"),
        ({"loss": {"aggregation": "mean"}}, "loss.aggregation"),
        ({"loss": {"trust_region": "ppo_clip_relax"}}, "loss.relax_alpha"),
        ({"task": {"options": "{not json"}}, "task.options"),
        ({"optim": {"lr": -1.0}}, "optim.lr"),
        ({"advantage": {"estimator": "gae"}}, "advantage.estimator"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        replace(get_preset("smoke"), **overrides)


def test_bad_data_fails_before_any_model_is_loaded(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"\n')
    cfg = smoke_config(tmp_path / "run", model={"name": str(tmp_path / "no-such-model")},
                       task={"name": "file", "options": json.dumps({"path": str(data), "prompt_column": "question",
                                                                    "answer_column": "answer"})})
    with pytest.raises(ValueError, match=r"data\.jsonl.*2|line 2"):
        Trainer(cfg, tmp_path / "run")


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["train", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


BAD_REWARDS = '''
import time

def raises(completion, example):
    raise RuntimeError("boom")

def hangs(completion, example):
    time.sleep(3600)
'''


def test_failing_and_hanging_rewards_are_contained(tmp_path):
    path = tmp_path / "bad_rewards.py"
    path.write_text(BAD_REWARDS)
    for fn, key in (("raises", "reward/failures"), ("hangs", "reward/timeouts")):
        cfg = replace(_smoke(tmp_path / fn, f"{path}:{fn}"), task={"reward_timeout_s": 1.0},
                      rollout={"prompts_per_step": 2, "group_size": 2}, train={"mini_batches": 1})
        trainer = Trainer(cfg, tmp_path / fn)
        try:
            metrics = trainer.step()
        finally:
            trainer.close()
        assert metrics["reward/mean"] == 0.0
        assert metrics[key] == 4.0, metrics


def test_lora_trains_only_the_adapter_and_syncs_merged_weights(tmp_path, reward_file):
    cfg = _smoke(tmp_path, reward_file, model={"lora_rank": 4, "lora_target_modules": ("q_proj", "v_proj")})
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.step()
        names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert names and all("lora_" in n for n in names)
        # after the sync, the engine scores like the trainer's merged model
        m = trainer.step()
        assert m["mismatch/binary_tv_mean"] < 1e-5, m["mismatch/binary_tv_mean"]
        path = trainer.save()
    finally:
        trainer.close()
    saved = load_file(str(path / "model.safetensors"))
    assert set(saved) == names


def test_eval_command_on_a_run(tmp_path, reward_file, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--task.reward", reward_file,
                 "--train.steps", "1", "--log.no-progress", "--log.report-to", "none"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["source"].endswith("step_000001") and 0.0 <= out["reward_mean"] <= 1.0 and out["n"] == 16
    assert main(["plot", str(run), str(run), "--out", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").stat().st_size > 1000


def test_fused_optimizer_matches_the_reference_adamw():
    """make_optimizer's fused AdamW gives the per-parameter reference AdamW's update (clipped gradients, weight
    decay, several steps) to float32 rounding."""
    from dppo.train.optim import make_optimizer

    torch.manual_seed(0)
    a = [torch.randn(37, 11, requires_grad=True), torch.randn(5, requires_grad=True)]
    b = [p.detach().clone().requires_grad_(True) for p in a]
    start = [p.detach().clone() for p in a]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    fast, ref = make_optimizer(a, **hyper), torch.optim.AdamW(b, foreach=False, **hyper)
    assert fast.defaults["fused"]
    for step in range(5):
        grads = [torch.randn_like(p) * (step + 1) for p in a]
        for params, opt in ((a, fast), (b, ref)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    for p, q, p0 in zip(a, b, start):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert (p - p0).abs().mean() > 1e-2  # the parameters moved: the comparison is not between untouched tensors


def test_a_run_directory_works_from_any_directory(tmp_path, monkeypatch, capsys):
    """A file-task run with a plug-in reward file, started with relative paths: config.yaml holds them absolute, so
    `dppo eval --run-dir ABSOLUTE` works from another directory; a moved data file is an error naming it."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    (work / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                             for a in range(6) for b in range(6)))
    (work / "my_reward.py").write_text(REWARD_SRC)
    monkeypatch.chdir(work)
    options = json.dumps({"path": "data.jsonl", "chat": False, "eval_fraction": 0.25})
    assert main(["train", "--preset", "smoke", "--run-dir", "run", "--task.name", "file", "--task.options", options,
                 "--task.reward", "my_reward.py:digit_fraction", "--task.eval-size", "4", "--train.steps", "1",
                 "--log.no-progress", "--log.report-to", "none"]) == 0
    saved = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert json.loads(saved["task"]["options"])["path"] == str(work / "data.jsonl")
    assert saved["task"]["reward"] == f"{work / 'my_reward.py'}:digit_fraction"
    capsys.readouterr()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", "--run-dir", str(work / "run")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["source"].endswith("step_000001") and out["n"] == 4  # task.eval_size 4 of the 9 held-out rows
    (work / "data.jsonl").rename(work / "moved.jsonl")
    assert main(["eval", "--run-dir", str(work / "run")]) != 0
    assert str(work / "data.jsonl") in capsys.readouterr().err
