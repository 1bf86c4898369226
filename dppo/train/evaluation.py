"""Evaluation on held-out questions (sampled pass@1, mean reward), and what the engine and the reward need from a
batch: the engine's prompts, the decoded responses. Used by the trainer, `dppo eval` and the studies.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from dppo.rollout.base import SamplingParams
from dppo.train.batch import RolloutBatch, collate
from dppo.train.build import build_engine, build_model, build_reward_runner, build_task, episode_spec
from dppo.run_files.checkpoint import load_full_state, load_latest
from dppo.train.config import Config
from dppo.train.distributed import Dist
from dppo.train.weights import trainable_state


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


def engine_prompts(examples, tokenizer) -> list:
    """What the engine takes: chat messages as they are, raw-text prompts as token ids (no template)."""
    return [list(tokenizer.encode(ex.prompt, add_special_tokens=False)) if isinstance(ex.prompt, str) else list(ex.prompt)
            for ex in examples]


def evaluate(engine, tokenizer, reward_runner, examples, params: SamplingParams, *, pad_id: int,
             episodes: bool = False) -> dict[str, float]:
    """params.n sampled responses per example: pass@1 (reward >= 1) and mean reward over all of them. `engine`: an
    engine or a `RolloutSource` (anything with `generate(prompts, params)`). episodes: the source runs multi-turn
    episodes (it takes the examples; the environment's rewards are used, and turns and tool calls are reported)."""
    if not examples:
        raise ValueError("examples: the evaluation set is empty")
    if episodes:
        from dppo.train import episodes as episode_metrics

        rollouts = engine.generate(list(examples), params)
        rewards, _ = episode_metrics.rewards(rollouts)
        batch = collate(rollouts, pad_id=pad_id)
        stats = episode_metrics.episode_stats(rollouts)
        extra = {"turns": stats["episode/turns_mean"], "tool_calls": stats["episode/tool_calls_mean"],
                 "tool_errors": stats["episode/tool_errors_mean"]}
    else:
        batch = collate(engine.generate(engine_prompts(examples, tokenizer), params), pad_id=pad_id)
        completions = decode_responses(batch, tokenizer)
        rewards, _ = reward_runner(completions, [examples[i] for i in batch.prompt_index.tolist()])
        extra = {}
    return {"pass@1": float((rewards >= 1.0 - 1e-6).float().mean()), "reward_mean": float(rewards.mean()),
            "n": len(examples) * params.n, "temperature": params.temperature,
            "response_length": float(batch.response_lengths.float().mean()), **extra}


def evaluate_checkpoint(cfg: Config, run_dir: Path | None) -> dict[str, float]:
    """Evaluate the base model of `cfg`, or the newest checkpoint of `run_dir`, on the task's held-out split."""
    task = build_task(cfg)
    runner = build_reward_runner(cfg, task)
    model, tokenizer, path = build_model(cfg, Path(cfg.log.run_dir or "."))
    source = "base model"
    if run_dir is not None:
        found = load_latest(run_dir)
        if found is None:
            raise ValueError(f"--run-dir: no complete checkpoint under {run_dir / 'checkpoints'}")
        source, ckpt = str(found[0]), found[1]
        load_checkpoint_weights(model, ckpt["weights"], found[0], flag="--run-dir")
    engine = build_engine(cfg, model)
    spec = episode_spec(cfg)
    sampler = engine if spec is None else _Episodes(engine, spec)
    try:
        temp = cfg.train.eval_temperature or cfg.rollout.temperature
        eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        params = SamplingParams(n=cfg.train.eval_samples_per_prompt, temperature=temp, max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=eos,
                                seed=cfg.train.seed)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return {"source": source, "task": cfg.task.name,
                **evaluate(sampler, tokenizer, runner, list(task.eval), params, pad_id=pad, episodes=spec is not None)}
    finally:
        getattr(engine, "close", lambda: None)()


class _Episodes:
    """An engine that runs the run's episodes (`dppo eval` with an `env` section): `generate(examples, params)`."""

    def __init__(self, engine, spec) -> None:
        from dppo.rollout.episodes import EpisodeCollector

        self.engine, self.collect = engine, EpisodeCollector(spec)

    def generate(self, examples, params: SamplingParams):
        return self.collect(self.engine, examples, params)
