"""Evaluation on held-out questions (sampled pass@1, pass@k and maj@k, mean reward) through the run's episodes, the same
path as training (single answers and multi-turn episodes alike). Used by the trainer, `dppo eval` and the studies.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dppo.episodes.results import episode_rewards, episode_success, first_rows
from dppo.episodes.single import engine_prompts  # (re-exported for the studies)
from dppo.metrics import maj_at_k, pass_at_k, pass_at_k_values
from dppo.rewards.votes import VoteRule, episode_text, vote_rule
from dppo.rollout.base import SamplingParams
from dppo.rollout.source import EngineSource
from dppo.train.batch import collate
from dppo.train.build import build_episodes, build_model, build_task
from dppo.train.rollout_build import build_rollout_engine
from dppo.run_files.checkpoint import load_checkpoint, load_full_state, load_latest
from dppo.run_files.run_dir import checkpoint_path, complete_checkpoints
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


def evaluate(source, examples, params: SamplingParams, *, pad_id: int, ks: Sequence[int] | None = None,
             vote: VoteRule | None = None) -> dict[str, float]:
    """params.n sampled episodes per example from `source` (a `RolloutSource`: they come back scored): pass@1
    (the share that succeeded: `episode_success`, the environment's verdict or reward >= 1), the unbiased pass@k
    (`dppo.metrics.pass_at_k`) for each k > 1 of `ks` (None: 2, 4, ... and n), with `vote` (a sample's answer:
    `dppo.rewards.votes`) maj@k for each k of `ks` (`dppo.metrics.maj_at_k`), the mean reward over all of them, and
    for multi-turn episodes the mean turns and tool calls, and `episode_failures` / `episode_timeouts` when episodes
    (their environment, agent or reward) failed or timed out (each scored 0). n = examples x params.n samples."""
    if not examples:
        raise ValueError("examples: the evaluation set is empty")
    ks = pass_at_k_values(params.n) if ks is None else sorted(set(ks))
    bad = [k for k in ks if not 1 <= k <= params.n]
    if bad:
        raise ValueError(f"k: {bad[0]} is not in [1, samples per prompt = {params.n}]")
    rollouts = source.generate(list(examples), params)
    rewards, counts = episode_rewards(rollouts)
    success = episode_success(rollouts, rewards)
    batch = collate(rollouts, pad_id=pad_id)
    stats = source.episodes.metrics(rollouts)
    extra = {k: stats[f"episode/{k}_mean"] for k in ("turns", "tool_calls", "tool_errors")
             if f"episode/{k}_mean" in stats}  # (multi-turn environments report them)
    episodes = first_rows(rollouts)  # (an agent's episode may be several rows)
    correct = torch.bincount(torch.tensor([r.prompt_index for r in episodes]), weights=success.double(),
                             minlength=len(examples))  # successes per example, of its params.n samples
    pass_k = {f"pass@{k}": float(pass_at_k(correct, params.n, k).mean()) for k in ks if k > 1}
    if vote is not None:
        votes: list[list] = [[] for _ in examples]
        for r, ok in zip(episodes, success.tolist()):
            text = episode_text(r.episode.completion, r.episode.messages)
            votes[r.prompt_index].append((vote(text, examples[r.prompt_index]), float(ok)))
        pass_k.update({f"maj@{k}": sum(m) / len(m) for k in ks
                       for m in [maj_at_k(votes, k, seed=params.seed or 0)]})
    return {"pass@1": float(success.float().mean()), **pass_k, "reward_mean": float(rewards.mean()),
            "n": len(examples) * params.n, "samples_per_prompt": params.n, "temperature": params.temperature,
            "response_length": float(batch.response_lengths.float().mean()), **extra,
            **{f"episode_{k}": v for k, v in counts.items() if v}}  # episodes that failed / timed out, when any


def eval_line(step: int, result: dict[str, float]) -> str:
    """The trainer's line for an evaluation `result` at `step`, naming the episodes that failed or timed out."""
    return (f"[dppo] eval @ step {step}: pass@1 {result['pass@1']:.3f}, mean reward {result['reward_mean']:.3f} "
            f"over {result['n']} held-out samples{failed_part(result)}")


def failed_part(result: dict[str, Any]) -> str:
    """", N failures (scored 0), M timeouts (scored 0)" for the episodes of `result` that failed or timed out ('' if
    none): every line that reports an evaluation says them (the step's line, `dppo train`'s closing lines)."""
    return "".join(f", {result[k]} {k.split('_')[1]} (scored 0)" for k in ("episode_failures", "episode_timeouts")
                   if result.get(k))


def _step_of(folder: Path) -> int:
    return int(folder.name.split("_")[1])


def _checkpoints(run_dir: Path, step: int | None, every: bool) -> list[tuple[Path, dict | None]]:
    """The checkpoint folders to evaluate, each with its loaded checkpoint when already read (None: load it): every
    complete one (`every`), the one of `step`, or the newest that loads."""
    found = complete_checkpoints(run_dir)
    if not found:
        raise ValueError(f"--run-dir: no complete checkpoint under {run_dir / 'checkpoints'}")
    if every:
        return [(p, None) for p in found]
    if step is None:
        newest = load_latest(run_dir)  # a corrupt newest one is reported and the previous one taken
        if newest is None:
            raise ValueError(f"--run-dir: no checkpoint under {run_dir / 'checkpoints'} loads")
        return [newest]
    chosen = [p for p in found if p == checkpoint_path(run_dir, step)]
    if not chosen:
        steps = ", ".join(str(_step_of(p)) for p in found)
        raise ValueError(f"--step: run {run_dir} has no complete checkpoint of step {step} (it has: {steps})")
    return [(chosen[0], None)]


def evaluate_checkpoints(cfg: Config, run_dir: Path | None, *, step: int | None = None, every: bool = False,
                         samples: int | None = None, ks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Evaluate on the task's held-out split the base model of `cfg` (run_dir None), or a checkpoint of `run_dir`:
    the newest, that of `step`, or every complete one (`every`, oldest first: a curve), with `samples` responses
    per prompt (None: train.eval_samples_per_prompt), pass@k and maj@k for `ks` (None: `evaluate`'s). One result
    per model, each with its "source" and "step" (0 for the base model); one engine is built and given each
    checkpoint's weights in turn."""
    task = build_task(cfg)
    if not task.eval:
        raise ValueError(f"task.eval_size: {task.name!r} has no held-out questions to evaluate (eval_size "
                         f"{cfg.task.eval_size}); give eval_size > 0 (a file task: eval_path or eval_fraction > 0)")
    n = cfg.train.eval_samples_per_prompt if samples is None else samples
    if n < 1:
        raise ValueError(f"--samples: expected >= 1, got {n}")
    folders = [] if run_dir is None else _checkpoints(run_dir, step, every)
    model, tokenizer, _ = build_model(cfg, Path(cfg.log.run_dir or "."))
    temp = cfg.train.eval_temperature or cfg.rollout.temperature
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    params = SamplingParams(n=n, temperature=temp, max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=eos,
                            top_k_logprobs=cfg.top_k_logprobs, seed=cfg.train.seed)  # (K as in training: clients' top_logprobs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vote = vote_rule(task.reward)  # (the task's reward, or task.reward's override)
    source = None
    try:
        results = []
        for folder, ckpt in folders or [(None, None)]:
            origin, at = "base model", 0
            if folder is not None:
                ckpt = load_checkpoint(folder) if ckpt is None else ckpt
                load_checkpoint_weights(model, ckpt["weights"], folder, flag="--run-dir")
                origin, at = str(folder), _step_of(folder)
            if source is None:
                source = EngineSource(build_rollout_engine(cfg), None, weights=engine_state(model), version=at,
                                      start_position=0, episodes=build_episodes(cfg, task),
                                      lags=[0] * len(cfg.rollout.engines))
            else:
                source.publish(at, engine_state(model))
            result = evaluate(source, list(task.eval), params, pad_id=pad, ks=ks, vote=vote)
            results.append({"source": origin, "task": task.name, "step": at, **result})
        return results
    finally:
        if source is not None:
            source.close()


def evaluate_checkpoint(cfg: Config, run_dir: Path | None, **kwargs: Any) -> dict[str, Any]:
    """`evaluate_checkpoints` of one model: the base model, or the newest checkpoint of `run_dir` (or `step=N`'s)."""
    return evaluate_checkpoints(cfg, run_dir, every=False, **kwargs)[0]


__all__ = ["engine_prompts", "eval_line", "evaluate", "failed_part", "evaluate_checkpoint", "evaluate_checkpoints", "load_checkpoint_weights",
           "vote_rule"]
