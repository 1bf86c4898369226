"""A single answer per prompt, as a one-turn episode: the task's prompt, one reply, the task's reward.

The whole batch is ONE engine call (params.n answers per prompt, `engine_prompts`) and ONE call of the task's
`RewardRunner`, in the trainer's process (`score`): a reward that raises or times out gives 0.0, counted in the
record's env_errors / env_timeouts; a non-finite one raises `NonFiniteRewardError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from dppo.rollout.base import EnginePrompt, Episode, Rollout, SamplingParams


def engine_prompts(examples, tokenizer) -> list[EnginePrompt]:
    """What the engine takes for a single answer: chat messages as they are, raw-text prompts as token ids (no
    template)."""
    return [list(tokenizer.encode(ex.prompt, add_special_tokens=False)) if isinstance(ex.prompt, str)
            else list(ex.prompt) for ex in examples]


@dataclass
class SingleAnswer:
    """The run's single answers (`dppo.rollout.source.Episodes`; module docstring). Pickled without its reward: a
    rollout worker only collects."""

    max_tokens: int
    """The answer's max_new_tokens (rollout.max_new_tokens)."""
    reward: Any = field(default=None, repr=False, compare=False)
    """The task's `RewardRunner` (only where `score` runs)."""
    max_turns = 1

    def __getstate__(self):
        return {"max_tokens": self.max_tokens}

    def __setstate__(self, state) -> None:
        self.max_tokens, self.reward = state["max_tokens"], None

    def collector(self):
        return self.collect

    def collect(self, engine, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        rollouts = engine.generate(engine_prompts(examples, engine.tokenizer), params)
        texts = engine.tokenizer.batch_decode([r.response_ids.tolist() for r in rollouts], skip_special_tokens=True)
        for r, text in zip(rollouts, texts):
            r.episode = Episode(completion=text)
        return rollouts

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        if self.reward is None:
            raise RuntimeError("SingleAnswer.score: no reward runner (a pickled copy only collects)")
        rewards, _ = self.reward([r.episode.completion for r in rollouts], [examples[r.prompt_index] for r in rollouts])
        for r, value, status in zip(rollouts, rewards.tolist(), self.reward.last_status):
            r.reward = value
            r.episode.env_errors, r.episode.env_timeouts = float(status == "failure"), float(status == "timeout")

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        return {}

    def check(self, example) -> str | None:
        return None


__all__ = ["SingleAnswer", "engine_prompts"]
