"""Golden outputs of the trainer: record them on one commit, check a later commit against them (issue 31, item 4).

    .venv/bin/python scripts/golden.py record docs/data/golden      # on the commit before a refactor
    .venv/bin/python scripts/golden.py check docs/data/golden       # after it: every value bitwise equal

Each run is a small training job on the tiny in-process model (no download): its per-step metrics (all but the
wall-clock ones: `*_s`, `*idle_frac`, `perf/tokens_per_s`) and the sha256 of every tensor of its final weights. The runs:
- `smoke`: the smoke preset (single-turn, fp32 `hf` engine, DPPO-Binary-TV).
- `smoke-bf16-topk`: the smoke preset with a bf16 `hf` engine (µ ≠ π) and DPPO-Top-K-TV with δ 0.02 and lr 1e-2: the mask really masks.
- `smoke-recompute`: bf16 engine, the recompute anchor with the mismatch split, a PPO clip of 0.05, lr 1e-2.
- `episodes`: the tiny model in 3-turn episodes of `tests/data/scripted_env.py:Scripted` (multi-turn, per-turn
  metrics), bf16 engine, 2 epochs, δ 0.05, lr 1e-2.
- `feedback`: the built-in `feedback` environment (retries), fp32 engine.
- `lagged`: the smoke preset with `rollout.engine_lag 1`.
- `async-0`: rollout workers with `rollout.max_staleness 0` (one worker thread).
- `trl-one-step`: TRL's `DPPOTrainer` (dppo's adapter) for one optimiser step on the tiny model (needs trl).

Bitwise equality holds on one machine with one torch build (float kernels differ between CPUs); the folder's
`machine.json` names the machine the values were recorded on, and `check` says when it differs.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SCRIPTED = str(ROOT / "tests" / "data" / "scripted_env.py") + ":Scripted"


def _weights_digest(state: dict) -> dict[str, str]:
    import torch

    out = {}
    for name, t in sorted(state.items()):
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        out[name] = hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    return out


def _clean(metrics: dict) -> dict:
    drop = ("perf/tokens_per_s",)
    wall_clock = lambda k: k.endswith("_s") or k.endswith("idle_frac") or k in drop  # noqa: E731 - timings
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in sorted(metrics.items())
            if not wall_clock(k)}


def _trainer_run(tmp: Path, **sections) -> dict:
    import torch
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    torch.set_num_threads(1)
    sections.setdefault("train", {})
    sections["train"] = {"threads": 1, **sections["train"]}
    cfg = smoke_config(tmp, **sections)
    with Trainer(cfg, tmp) as trainer:
        steps = [_clean(trainer.step()) for _ in range(cfg.train.steps)]
        weights = _weights_digest(trainer.model.state_dict())
    return {"steps": steps, "weights": weights}


RUNS = {
    "smoke": {},
    "smoke-bf16-topk": {"rollout": {"dtype": "bfloat16"}, "optim": {"lr": 1e-2},
                        "loss": {"trust_region": "dppo_topk_tv", "delta_low": 0.02, "delta_high": 0.02}},
    "smoke-recompute": {"rollout": {"dtype": "bfloat16"}, "optim": {"lr": 1e-2},
                        "loss": {"trust_region": "ppo_clip", "eps_low": 0.05, "eps_high": 0.05, "anchor": "recompute",
                                 "split_mismatch": True}},
    "episodes": {"rollout": {"dtype": "bfloat16", "max_new_tokens": 4, "episodes": "env"}, "loss": {"delta_low": 0.05, "delta_high": 0.05},
                 "optim": {"lr": 1e-2},
                 "env": {"name": SCRIPTED, "options": '{"turns": 3}', "max_turns": 3, "max_tokens": 120},
                 "train": {"mini_batches": 1, "epochs": 2}},
    "feedback": {"rollout": {"max_new_tokens": 4, "episodes": "env"},
                 "env": {"name": "feedback", "max_turns": 3, "max_tokens": 60}},
    "lagged": {"rollout": {"engine_lag": 1}},
    "async-0": {"rollout": {"mode": "async", "max_staleness": 0, "worker_threads": 1, "worker_timeout_s": 120.0}},
}


def _trl_one_step(tmp: Path) -> dict:
    """The TRL adapter's one-step run of tests/integrations/test_trl.py (its `make_trainer` settings)."""
    import warnings

    import torch
    from conftest import TINY
    from datasets import Dataset
    from dppo.runtime.models import char_tokenizer, tiny_random_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dppo.integrations.trl import DPPOConfig, DPPOTrainer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = char_tokenizer()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i}+{i + 3}?"}],
                               "answer": str(2 * i + 3)} for i in range(16)])

    def reward(completions, answer, **_):
        return [float(len(set(c[0]["content"]))) for c in completions]

    args = DPPOConfig(output_dir=str(tmp / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                      learning_rate=1e-3, beta=0.0, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=10, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, temperature=0.7, lr_scheduler_type="constant")
    model = tiny_random_model(tok, **{**TINY, "seed": 0})
    trainer = DPPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    skip = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")
    logs = [_clean({k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and k not in skip})
            for entry in trainer.state.log_history]
    return {"steps": logs, "weights": _weights_digest(trainer.model.state_dict())}


def run_all(names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"[golden] {name} ...", flush=True)
            out[name] = _trl_one_step(Path(tmp)) if name == "trl-one-step" else _trainer_run(Path(tmp), **RUNS[name])
    return out


def _machine() -> dict:
    import torch

    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "torch": torch.__version__, "python": platform.python_version()}


RENAMED = {f"dppo/{old}": f"dppo/{new}" for old, new in {
    "masked_frac": "trust_region/masked_frac", "masked_frac_pos": "trust_region/masked_frac_pos",
    "masked_frac_neg": "trust_region/masked_frac_neg", "ratio_mean": "ratio/mean", "ratio_max": "ratio/max",
    "ratio_above_cap_frac": "ratio/above_cap_frac", "mismatch/tv_mean": "mismatch/binary_tv_mean",
    "mismatch/kl_mean": "mismatch/binary_kl_mean"}.items()}
"""Metric keys renamed on purpose since the golden was recorded (issue 31: one quantity, one name — the TRL adapter
logs `dppo train`'s names behind `dppo/`): a golden value under the old key is compared with the new key."""


def _compare(name: str, want: dict, got: dict) -> list[str]:
    problems = []
    want = {**want, "steps": [{RENAMED.get(k, k): v for k, v in step.items()} for step in want["steps"]]}
    if len(want["steps"]) != len(got["steps"]):
        problems.append(f"{name}: {len(got['steps'])} steps, golden {len(want['steps'])}")
    for i, (w, g) in enumerate(zip(want["steps"], got["steps"])):
        for key in sorted(set(w) | set(g)):
            if key not in g:
                problems.append(f"{name} step {i + 1}: {key} missing")
            elif key not in w:
                problems.append(f"{name} step {i + 1}: {key} new (not in the golden)")
            elif w[key] != g[key]:
                problems.append(f"{name} step {i + 1}: {key} = {g[key]!r}, golden {w[key]!r}")
    bad = [k for k in want["weights"] if want["weights"][k] != got["weights"].get(k)]
    if bad or set(want["weights"]) != set(got["weights"]):
        problems.append(f"{name}: final weights differ ({len(bad)} of {len(want['weights'])} tensors, e.g. "
                        f"{(bad or sorted(set(want['weights']) ^ set(got['weights'])))[0]})")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    action, folder, names = argv[0], Path(argv[1]), argv[2:] or [*RUNS, "trl-one-step"]
    if action == "record":
        folder.mkdir(parents=True, exist_ok=True)
        for name, result in run_all(names).items():
            (folder / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        (folder / "machine.json").write_text(json.dumps(_machine(), indent=1) + "\n")
        print(f"[golden] recorded {len(names)} runs in {folder}")
        return 0
    recorded = json.loads((folder / "machine.json").read_text())
    if recorded != _machine():
        print(f"[golden] note: recorded on {recorded}, this machine is {_machine()}: bitwise equality is not expected")
    problems = []
    for name, result in run_all(names).items():
        problems += _compare(name, json.loads((folder / f"{name}.json").read_text()), result)
    for line in problems:
        print(line)
    print(f"[golden] {len(names)} runs: " + ("all bitwise equal" if not problems else f"{len(problems)} differences"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
