"""Evaluation on held-out questions (sampled pass@1, mean reward) through the run's episodes, the same path as
training (single answers and multi-turn episodes alike), and the decoded responses of a batch. Used by the trainer,
`dppo eval` and the studies.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dppo.metrics import pass_at_k, pass_at_k_values
from dppo.rollout.base import SamplingParams
from dppo.rollout.episodes import engine_prompts, episode_rewards, episode_success  # (engine_prompts: re-exported for the studies)
from dppo.rollout.source import EngineSource
from dppo.rollout.spec import build_engine as engine_from_spec
from dppo.train.batch import RolloutBatch, collate
from dppo.train.build import build_episodes, build_model, build_task, engine_spec
from dppo.run_files.checkpoint import load_full_state, load_latest
from dppo.train.config import Config
from dppo.train.distributed import Dist
from dppo.train.weights import engine_state, trainable_state


def load_checkpoint_weights(model, weights: dict[str, Tensor], path: Path, *, flag: str, dist: Dist | None = None) -> None:
    """Load a checkpoint's trainable weights into `model` after comparing names and shapes (a mismatch would
    otherwise be a RuntimeError from torch); ValueError naming the checkpoint and `flag` on any mismatch."""
    own = model.state_dict()
    unexpected = sorted(set(weights) - set(own))
    missing = sorted(set(trainable_state(model)) - set(weights))
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(weights) & set(own))
              if weights[k].shape != own[k].shape]
    if unexpected or missing or shapes:
        raise ValueError(f"{flag}: checkpoint {path} does not match the model (a different model or model.* "
                         f"settings?): unexpected {unexpected[:3]}, missing {missing[:3]}, shape mismatch {shapes[:3]}")
    load_full_state(dist or Dist(), model, weights)


def decode_responses(batch: RolloutBatch, tokenizer) -> list[str]:
    """The response texts of a (CPU) batch, padding and special tokens dropped."""
    ids = [row[:n].tolist() for row, n in zip(batch.response_ids, batch.response_lengths.tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def evaluate(source, examples, params: SamplingParams, *, pad_id: int) -> dict[str, float]:
    """params.n sampled episodes per example from `source` (a `RolloutSource`: they come back scored): pass@1
    (the share that succeeded: `episode_success`, the environment's verdict or reward >= 1), with n > 1 the unbiased
    pass@k for k = 2, 4, ... and n (`dppo.metrics.pass_at_k`), and the mean reward over all of them, and for multi-turn episodes the mean turns and tool calls."""
    if not examples:
        raise ValueError("examples: the evaluation set is empty")
    rollouts = source.generate(list(examples), params)
    rewards, _ = episode_rewards(rollouts)
    success = episode_success(rollouts, rewards)
    batch = collate(rollouts, pad_id=pad_id)
    stats = source.episodes.metrics(rollouts)
    extra = {k: stats[f"episode/{k}_mean"] for k in ("turns", "tool_calls", "tool_errors")
             if f"episode/{k}_mean" in stats}  # (multi-turn environments report them)
    correct = torch.bincount(torch.tensor([r.prompt_index for r in rollouts]), weights=success.double(),
                             minlength=len(examples))  # successes per example, of its params.n samples
    pass_k = {f"pass@{k}": float(pass_at_k(correct, params.n, k).mean()) for k in pass_at_k_values(params.n) if k > 1}
    return {"pass@1": float(success.float().mean()), **pass_k, "reward_mean": float(rewards.mean()),
            "n": len(examples) * params.n, "temperature": params.temperature,
            "response_length": float(batch.response_lengths.float().mean()), **extra}


def evaluate_checkpoint(cfg: Config, run_dir: Path | None) -> dict[str, float]:
    """Evaluate the base model of `cfg`, or the newest checkpoint of `run_dir`, on the task's held-out split."""
    task = build_task(cfg)
    if not task.eval:
        raise ValueError(f"task.eval_size: {cfg.task.name!r} has no held-out questions to evaluate (eval_size "
                         f"{cfg.task.eval_size}); give eval_size > 0 (a file task: eval_path or eval_fraction > 0)")
    model, tokenizer, path = build_model(cfg, Path(cfg.log.run_dir or "."))
    origin = "base model"
    if run_dir is not None:
        found = load_latest(run_dir)
        if found is None:
            raise ValueError(f"--run-dir: no complete checkpoint under {run_dir / 'checkpoints'}")
        origin, ckpt = str(found[0]), found[1]
        load_checkpoint_weights(model, ckpt["weights"], found[0], flag="--run-dir")
    source = EngineSource(engine_from_spec(engine_spec(cfg)), None, weights=engine_state(model), version=0,
                          start_position=0, episodes=build_episodes(cfg, task))
    try:
        temp = cfg.train.eval_temperature or cfg.rollout.temperature
        eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        params = SamplingParams(n=cfg.train.eval_samples_per_prompt, temperature=temp, max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=eos,
                                seed=cfg.train.seed)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return {"source": origin, "task": cfg.task.name, **evaluate(source, list(task.eval), params, pad_id=pad)}
    finally:
        source.close()


__all__ = ["decode_responses", "engine_prompts", "evaluate", "evaluate_checkpoint", "load_checkpoint_weights"]
