"""Bad input fails early and names its culprit; corrupt or partial checkpoints are never loaded.

One table drives every bad input through a public entry point (`dppo.cli.main`, `Trainer`, `SamplingParams`,
an engine's `generate`, `make_task`, `get_reward`) and checks the error type and that the message names the
field, file, line or parameter at fault. The checkpoint tests write, truncate and interrupt checkpoints with
`dppo.run_files.checkpoint` directly and through `Trainer` resume. Everything runs on the `smoke` preset and the tiny
models of conftest.py; one smoke run (two checkpoints) is shared by the module.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import dppo.run_files.checkpoint as ckpt_mod
from dppo.run_files.checkpoint import load_latest, save_checkpoint
from dppo.run_files.run_dir import MARKER, complete_checkpoints
from dppo.cli import main
from dppo.train.config import ConfigError, replace
from dppo.train.presets import get_preset
from dppo.rewards import get_reward
from dppo.rollout import make_engine
from dppo.rollout.base import SamplingParams
from dppo.tasks import make_task
from dppo.train.trainer import Trainer

CLI = "cli"
"""Expected 'error type' of a CLI row: `main` returns 2 and its stderr error line matches the pattern."""

SMOKE_ARGS = ["--preset", "smoke", "--log.no-progress", "--log.report-to", "none", "--train.no-eval-before"]


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """A finished 2-step smoke run with checkpoints step_000001 and step_000002. Tests copy it before changing it."""
    run = tmp_path_factory.mktemp("smoke") / "run"
    assert main(["train", *SMOKE_ARGS, "--run-dir", str(run), "--train.steps", "2", "--train.checkpoint-every", "1"]) == 0
    assert [p.name for p in complete_checkpoints(run)] == ["step_000001", "step_000002"]
    return run


@dataclass
class Ctx:
    """What a table row may use: a scratch folder, the shared smoke run, the tiny model factory."""

    tmp: Path
    smoke_run: Path
    tokenizer: Any
    make_tiny_model: Callable[..., nn.Module]

    def run_copy(self, name: str = "run") -> Path:
        dst = self.tmp / name
        shutil.copytree(self.smoke_run, dst)
        return dst

    def data(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)


@pytest.fixture
def ctx(tmp_path, smoke_run, tokenizer, make_tiny_model) -> Ctx:
    return Ctx(tmp_path, smoke_run, tokenizer, make_tiny_model)


# ------------------------------------------------------------------------------------------------- helpers
def _cfg(**sections):
    return replace(get_preset("smoke"), **sections)


def _trainer(ctx: Ctx, **sections):
    """Trainer on the smoke preset; the model name is a folder that does not exist unless `model` is given, so a
    data error that is raised only after the model loads shows up as the wrong message."""
    sections.setdefault("model", {"name": str(ctx.tmp / "no-such-model")})
    cfg = _cfg(log={"run_dir": str(ctx.tmp / "run"), "report_to": ("none",), "progress": False}, **sections)
    Trainer(cfg, ctx.tmp / "run").close()


def _file_task(ctx: Ctx, name: str, text: str, **options):
    path = ctx.data(name, text)
    _trainer(ctx, task={"name": "file", "reward": "", "options": json.dumps({"path": path, **options})})


def _generate(ctx: Ctx, params: SamplingParams, prompt_len: int = 4, **model_overrides):
    engine = make_engine("hf", ctx.make_tiny_model(**model_overrides), ctx.tokenizer)
    engine.generate([list(range(10, 10 + prompt_len))], params)


def _corrupt(folder: Path, how: str = "truncate") -> None:
    target = folder / "model.safetensors"
    if how == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "state":
        (folder / "trainer_state.json").write_text('{"step": ')
    elif how == "optimizer":
        (folder / "optimizer.pt").unlink()


def _corrupt_all(run: Path) -> Path:
    for folder in complete_checkpoints(run):
        _corrupt(folder)
    return run


def _no_checkpoints(run: Path) -> Path:
    shutil.rmtree(run / "checkpoints")
    return run


# ------------------------------------------------------------------------------------------------- the table
@dataclass
class Row:
    id: str
    call: Callable[[Ctx], Any]
    """Raises the expected error (or, for CLI rows, returns the argv to pass to `main`)."""
    error: type[BaseException] | str
    pattern: str
    """re.search pattern the message must contain (it names the culprit)."""


ROWS = [
    # ---- config values (ConfigError at construction, naming the dotted field)
    Row("negative-lr", lambda c: _cfg(optim={"lr": -1e-3}), ConfigError, r"^optim\.lr: expected > 0, got -0\.001"),
    Row("delta-high-zero", lambda c: _cfg(loss={"delta_high": 0.0}), ConfigError, r"^loss\.delta_high: expected > 0"),
    Row("delta-low-negative", lambda c: _cfg(loss={"delta_low": -0.1}), ConfigError, r"^loss\.delta_low: expected > 0"),
    Row("unknown-trust-region", lambda c: _cfg(loss={"trust_region": "dppo_tv"}), ConfigError,
        r"^loss\.trust_region: unknown value 'dppo_tv'; valid: .*dppo_binary_tv"),
    Row("unknown-aggregation", lambda c: _cfg(loss={"aggregation": "mean"}), ConfigError,
        r"^loss\.aggregation: unknown value 'mean'; valid: .*token-mean"),
    Row("unknown-advantage", lambda c: _cfg(advantage={"estimator": "gae"}), ConfigError,
        r"^advantage\.estimator: unknown 'gae'; valid: .*group_mean"),
    Row("mini-batches-not-dividing", lambda c: _cfg(train={"mini_batches": 3}), ConfigError,
        r"^train\.mini_batches: must divide rollout\.prompts_per_step=4"),
    Row("group-size-1-group-advantage", lambda c: _cfg(rollout={"group_size": 1}), ConfigError,
        r"^rollout\.group_size: advantage 'group_mean' needs >= 2"),
    Row("topk-region-without-capture", lambda c: _cfg(loss={"trust_region": "dppo_topk_tv"}, rollout={"top_k_logprobs": 0}), ConfigError,
        r"^rollout\.top_k_logprobs: trust region 'dppo_topk_tv' needs"),
    Row("relax-without-alpha", lambda c: _cfg(loss={"trust_region": "ppo_clip_relax"}), ConfigError,
        r"^loss\.relax_alpha: required by trust_region 'ppo_clip_relax'"),
    Row("task-options-bad-json", lambda c: _cfg(task={"options": "{digits: 1}"}), ConfigError,
        r"^task\.options: not valid JSON"),
    Row("task-options-not-object", lambda c: _cfg(task={"options": "[1]"}), ConfigError,
        r"^task\.options: expected a JSON object, got list"),
    # ---- the command line (exit status 2, the error line names the flag or file)
    Row("unknown-preset", lambda c: ["train", "--preset", "nope"], CLI, r"--preset: unknown preset 'nope'; valid: demo"),
    Row("unknown-field-flag", lambda c: ["train", "--preset", "smoke", "--loss.nope", "1"], CLI,
        r"command line: could not parse --loss\.nope 1"),
    Row("bad-value-flag", lambda c: ["train", "--preset", "smoke", "--optim.lr", "-1"], CLI,
        r"could not parse --optim\.lr -1"),
    Row("missing-config-file", lambda c: ["train", "--config", str(c.tmp / "missing.yaml")], CLI,
        r"--config: file not found: .*missing\.yaml"),
    Row("config-file-unknown-field", lambda c: ["train", "--config", c.data("bad.yaml", "loss:\n  delta: 0.1\n")], CLI,
        r"loss\.delta: unknown field in .*bad\.yaml"),
    Row("resume-not-a-run", lambda c: ["train", "--resume", str(c.tmp)], CLI, r"--resume: .* is not a run directory"),
    Row("resume-without-checkpoint", lambda c: ["train", "--resume", str(_no_checkpoints(c.run_copy()))], CLI,
        r"--resume: no complete checkpoint under .*run/checkpoints"),
    Row("resume-different-model", lambda c: ["train", "--resume", str(c.run_copy()), "--model.name", "tiny-random-96x2",
                                             "--log.no-progress"], CLI,
        r"--resume: checkpoint .*run/checkpoints/step_000002 does not match the model.*shape mismatch .*\(96"),
    Row("resume-corrupt-checkpoints", lambda c: ["train", "--resume", str(_corrupt_all(c.run_copy())), "--log.no-progress"],
        CLI, r"--resume: every checkpoint is corrupt \(tried step_000002, step_000001\) under .*run/checkpoints"),
    Row("model-path-missing", lambda c: ["train", *SMOKE_ARGS, "--run-dir", str(c.tmp / "r"),
                                         "--model.name", str(c.tmp / "no-such-model")], CLI,
        r"model\.name: .*no-such-model' is neither a built-in model"),
    # ---- data (ValueError from Trainer before the model loads, naming the file, line and column)
    Row("missing-column", lambda c: _file_task(c, "cols.jsonl", '{"q": "1+1", "answer": "2"}\n'), ValueError,
        r"cols\.jsonl: line 1: missing column 'prompt'; columns present: \['answer', 'q'\]"),
    Row("extra-option-column-typo", lambda c: _file_task(c, "typo.jsonl", '{"prompt": "1+1", "answer": "2"}\n',
                                                        question_column="q"), ValueError,
        r"task 'file': unknown option\(s\) \['question_column'\]"),
    Row("malformed-jsonl-line", lambda c: _file_task(c, "bad.jsonl", '{"prompt": "1+1", "answer": "2"}\n{"prompt": \n'),
        ValueError, r"bad\.jsonl: line 2: malformed JSON"),
    Row("empty-data-file", lambda c: _file_task(c, "empty.jsonl", "\n"), ValueError, r"empty\.jsonl: the dataset is empty"),
    Row("data-file-missing",
        lambda c: _trainer(c, task={"name": "file", "options": json.dumps({"path": str(c.tmp / "none.jsonl")})}),
        ValueError, r"data file not found: .*none\.jsonl"),
    Row("unknown-task-trainer", lambda c: _trainer(c, task={"name": "chain_summ", "options": "{}"}), ValueError,
        r"task: unknown task 'chain_summ'; valid names: chain_sum"),
    Row("unknown-task", lambda c: make_task("nope"), ValueError, r"unknown task 'nope'"),
    Row("unknown-task-option", lambda c: make_task("addition", digitz=1), ValueError,
        r"task 'addition': unknown option\(s\) \['digitz'\]"),
    # ---- rewards
    Row("unknown-reward", lambda c: get_reward("exact"), ValueError, r"unknown reward 'exact'; valid names: exact_match"),
    Row("reward-module-missing", lambda c: get_reward("no_such_module_xyz:fn"), ValueError,
        r"reward 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'"),
    Row("reward-attribute-missing", lambda c: get_reward("dppo.rewards.builtin:nope"), ValueError,
        r"'dppo\.rewards\.builtin' has no attribute 'nope'; it defines \[.*exact_match"),
    Row("reward-file-missing", lambda c: get_reward(f"{c.tmp}/none.py:fn"), ValueError, r"file not found: .*none\.py"),
    Row("unknown-reward-trainer", lambda c: _trainer(c, task={"reward": "nope"}), ValueError, r"unknown reward 'nope'"),
    # ---- sampling and engines
    Row("top-p-with-topk-capture", lambda c: SamplingParams(top_k_logprobs=5, top_p=0.9), ValueError,
        r"^top_p/top_k/min_p: truncated sampling changes µ"),
    Row("top-k-with-topk-capture", lambda c: SamplingParams(top_k_logprobs=5, top_k=10), ValueError, r"^top_p/top_k/min_p:"),
    Row("min-p-with-topk-capture", lambda c: SamplingParams(top_k_logprobs=5, min_p=0.1), ValueError, r"^top_p/top_k/min_p:"),
    Row("min-p-out-of-range", lambda c: SamplingParams(min_p=1.5), ValueError, r"^min_p: expected in \[0, 1\]"),
    Row("temperature-zero", lambda c: SamplingParams(temperature=0.0), ValueError, r"^temperature: expected > 0, got 0\.0"),
    Row("k-above-engine-cap", lambda c: _generate(c, SamplingParams(top_k_logprobs=101)), ValueError,
        r"^top_k_logprobs: 101 exceeds this engine's max_logprobs 100"),
    Row("prompt-longer-than-context", lambda c: _generate(c, SamplingParams(max_new_tokens=8), prompt_len=12,
                                                          max_position_embeddings=16), ValueError,
        r"^max_new_tokens: prompt 0 has 12 tokens; 12 \+ max_new_tokens 8 exceeds the model's context 16"),
    Row("k-above-engine-cap-trainer",
        lambda c: _trainer(c, model={"name": "tiny-random"}, rollout={"top_k_logprobs": 101}), ValueError,
        r"^rollout\.top_k_logprobs: 101 exceeds the hf engine's max_logprobs 100"),
    Row("model-path-missing-trainer", lambda c: _trainer(c), ValueError, r"^model\.name: .*no-such-model"),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in ROWS])
def test_bad_input_names_the_culprit(row: Row, ctx: Ctx, capsys):
    if row.error == CLI:
        argv = row.call(ctx)
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        line = next((ln for ln in reversed(err.splitlines()) if ln.startswith("dppo train: error: ")), err)
        assert re.search(row.pattern, line), f"{row.pattern!r} not in {line!r}"
    else:
        with pytest.raises(row.error, match=row.pattern):
            row.call(ctx)


def test_the_table_covers_the_issue():
    assert len(ROWS) >= 20 and len({r.id for r in ROWS}) == len(ROWS)


# ------------------------------------------------------------------------------------------------- checkpoints
def _save(run: Path, step: int, keep: int = 5) -> Path:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(float(step))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(run, step, weights=dict(model.named_parameters()), optimizer=opt, scheduler=sched,
                           trainer_state={"sampler_position": step}, keep=keep)


def test_partial_and_temporary_folders_are_never_loaded(tmp_path):
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    partial = shutil.copytree(good, good.parent / "step_000003")  # a write killed before its marker
    (partial / MARKER).unlink()
    shutil.copytree(good, good.parent / ".tmp_step_000004_123")  # killed after the marker, before the rename
    warnings: list[str] = []
    assert complete_checkpoints(tmp_path) == [good.parent / "step_000001", good]
    path, ckpt = load_latest(tmp_path, warn=warnings.append)
    assert path == good and ckpt["trainer_state"]["step"] == 2 and not warnings


def test_a_save_interrupted_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    good = _save(tmp_path, 1)

    def crash(*args):
        raise OSError("killed")

    monkeypatch.setattr(ckpt_mod.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp_")]
    assert complete_checkpoints(tmp_path) == [good]
    assert load_latest(tmp_path, warn=pytest.fail)[0] == good


@pytest.mark.parametrize("how", ["truncate", "state", "optimizer"])
def test_a_corrupt_newest_checkpoint_is_named_and_the_previous_one_loads(tmp_path, how):
    first, newest = _save(tmp_path, 1), _save(tmp_path, 2)
    _corrupt(newest, how)
    warnings: list[str] = []
    path, ckpt = load_latest(tmp_path, warn=warnings.append)
    assert path == first and torch.equal(ckpt["weights"]["weight"], torch.ones(2, 3))
    assert len(warnings) == 1 and re.search(rf"skipping {re.escape(str(newest))}: corrupt checkpoint", warnings[0])


def test_all_corrupt_gives_none_after_naming_each(tmp_path):
    folders = [_save(tmp_path, 1), _save(tmp_path, 2)]
    for f in folders:
        _corrupt(f)
    warnings: list[str] = []
    assert load_latest(tmp_path, warn=warnings.append) is None
    assert [w.split(": ")[0] for w in warnings] == [f"[dppo] skipping {f}" for f in reversed(folders)]


def _resume_cfg(run: Path):
    cfg = replace(get_preset("smoke"), train={"steps": 2, "checkpoint_every": 1, "eval_before": False})
    return replace(cfg, log={"run_dir": str(run), "report_to": ("none",), "progress": False})


def test_trainer_resume_skips_a_corrupt_newest_checkpoint(tmp_path, smoke_run, capsys):
    run = shutil.copytree(smoke_run, tmp_path / "run")
    _corrupt(run / "checkpoints" / "step_000002")
    trainer = Trainer(_resume_cfg(run), run, resume=True)
    trainer.close()
    out = capsys.readouterr().out
    assert trainer.step_idx == 1 and trainer.sampler.position == 4
    assert f"skipping {run / 'checkpoints' / 'step_000002'}: corrupt checkpoint" in out
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} at step 1" in out


def test_trainer_resume_with_every_checkpoint_corrupt_names_the_folder(tmp_path, smoke_run):
    run = _corrupt_all(shutil.copytree(smoke_run, tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"every checkpoint is corrupt .* under {re.escape(str(run / 'checkpoints'))}"):
        Trainer(_resume_cfg(run), run, resume=True)
