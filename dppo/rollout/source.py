"""`RolloutSource`: the one thing the trainer asks for data and tells about new weights, in every sampling mode.

    take(step)               -> (examples, rollouts) of training step `step` (0-based)
    publish(version, weights)   the weights after `version` optimiser steps (a state dict with HF names)
    generate(prompts, params)   sampling outside training (evaluation), with the newest weights the source holds
    metrics()                -> the source's own metrics of the last step (floats; {} when it has none)
    close()

**Versions.** Version v = the weights after v optimiser steps of the run. Every source stamps each rollout with
the *published* version that sampled it (`Rollout.weight_version`; with in-flight updates each token in
`Rollout.token_versions`), so the staleness of a response trained at step s is s − version in every mode —
measured from what was recorded, never computed from a formula. `take` checks it against `max_staleness` here,
in one place.

Implementations:
- `EngineSource(engine, draw, lag=0)`: an engine in this process. lag 0 = synchronous (the engine gets every
  version as it is published); lag k > 0 = `rollout.engine_lag`: the engine gets version v only once version v + k
  is published (CPU copies wait in a queue), a deterministic stand-in for asynchronous staleness.
- `dppo.rollout.async_source.AsyncSource`: rollout workers in other processes (or Ray actors) that sample ahead.

**Episodes.** With an `EpisodeSpec` (`dppo.rollout.episodes`), every source runs multi-turn episodes instead of
single responses: the draw's `prompts` are then the task examples, and the same episode code runs in this process
(sync, lagged) and in the rollout workers (async: the spec travels with each request).

`draw(step) -> Draw` is the trainer's prompt draw (examples, engine prompts, sampling parameters, and the prompt
sampler's position after it); `trained_position` is that position after the last batch `take` returned, which a
checkpoint stores (a resumed run draws any batches that were in flight again).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import Tensor

from dppo.rollout.base import EnginePrompt, Rollout, SamplingParams


@dataclass
class Draw:
    """The prompts of one training step."""

    examples: list
    """The task examples (rollouts' `prompt_index` indexes this list)."""
    prompts: list[EnginePrompt]
    """What the engine takes for each example (token ids or chat messages)."""
    params: SamplingParams
    position: int
    """The prompt sampler's position after this draw."""


class StalenessError(RuntimeError):
    """A source returned a response older than its staleness bound (a scheduling bug, never silently trained)."""


def sample(engine, prompts: Sequence, params: SamplingParams, collector=None) -> list[Rollout]:
    """One batch from `engine`: single responses (`engine.generate`), or episodes when `collector` (an
    `EpisodeCollector`) is given, `prompts` then being task examples."""
    return engine.generate(prompts, params) if collector is None else collector(engine, prompts, params)


class RolloutSource:
    """Base of every source: the staleness check of `take` and the position bookkeeping (see the module)."""

    max_staleness: int = 0
    """The largest staleness this source can return (sync 0, lagged k, async rollout.max_staleness)."""
    engine: Any = None
    """The in-process engine, if the source has one (None for rollout workers)."""

    def __init__(self, draw: Callable[[int], Draw], *, start_position: int) -> None:
        self.draw = draw
        self.trained_position = start_position

    def take(self, step: int) -> tuple[list, list[Rollout]]:
        examples, rollouts, position = self._take(step)
        old = min((r.weight_version for r in rollouts), default=step)
        if step - old > self.max_staleness or any(r.weight_version > step for r in rollouts):
            raise StalenessError(f"step {step}: a response sampled under version {old} (staleness {step - old}), "
                                 f"bound {self.max_staleness}")
        self.trained_position = position
        return examples, rollouts

    def _take(self, step: int) -> tuple[list, list[Rollout], int]:
        raise NotImplementedError

    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def stamp(rollouts: list[Rollout], version: int, *, in_flight: bool = False) -> list[Rollout]:
    """Mark every rollout (and, unless the engine recorded per-token versions during in-flight updates, every
    token) as sampled under published version `version`."""
    for r in rollouts:
        r.weight_version = version
        if r.token_versions is not None and not in_flight:
            r.token_versions.fill_(version)
    return rollouts


class EngineSource(RolloutSource):
    """An engine in the trainer's process, `lag` versions behind the trainer (0 = synchronous)."""

    def __init__(self, engine, draw: Callable[[int], Draw], *, weights: dict[str, Tensor], version: int,
                 start_position: int, lag: int = 0, episodes=None) -> None:
        super().__init__(draw, start_position=start_position)
        if lag < 0:
            raise ValueError(f"rollout.engine_lag: expected >= 0, got {lag}")
        self.engine, self.lag, self.max_staleness = engine, lag, lag
        self.collector = None
        if episodes is not None:
            from dppo.rollout.episodes import EpisodeCollector

            self.collector = EpisodeCollector(episodes)
        self._waiting: collections.deque = collections.deque()  # (version, CPU state dict) not yet loaded
        self._load(version, weights)

    def _load(self, version: int, weights) -> None:
        self.engine.load_weights(weights)
        self.version = version

    def _take(self, step: int):
        d = self.draw(step)
        return d.examples, stamp(sample(self.engine, d.prompts, d.params, self.collector), self.version), d.position

    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        if not self.lag:
            self._load(version, weights)
            return
        self._waiting.append((version, {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}))
        if len(self._waiting) > self.lag:
            self._load(*self._waiting.popleft())

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        return stamp(sample(self.engine, prompts, params, self.collector), self.version)

    def close(self) -> None:
        self.engine.close()

