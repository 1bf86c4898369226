"""`RolloutSource`: the one thing the trainer asks for data and tells about new weights, in every sampling mode.

    take(step)               -> (examples, rollouts) of training step `step` (0-based), every rollout scored
    publish(version, weights)   the weights after `version` optimiser steps (a state dict with HF names)
    generate(examples, params)  episodes outside training (evaluation, scored), with the newest weights it holds
    metrics()                -> the source's own metrics of the last step (floats; {} when it has none)
    close()

**Versions.** Version v = the weights after v optimiser steps of the run. Every source stamps each rollout with
the *published* version that sampled it (`Rollout.weight_version`; with in-flight updates each token in
`Rollout.token_versions`), so the staleness of a response trained at step s is s − version in every mode —
measured from what was recorded, never computed from a formula. `take` checks it against `max_staleness` here,
in one place.

Implementations:
- `EngineSource(engine, draw, lags=(0,))`: the run's engines in this process. lag 0 = synchronous (the engine gets
  every version as it is published); lag k > 0 = the engine's `lag` (rollout.engines[j].lag, `--rollout.engine-lag`):
  it gets version v only once version v + k
  is published (CPU copies wait in a queue), a deterministic stand-in for asynchronous staleness.
- `dppo.rollout.async_source.AsyncSource`: rollout workers in other processes (or Ray actors) that sample ahead.

**Episodes.** Every source runs the run's episodes (`episodes`, an `Episodes`: `dppo.episodes` builds them — single
answers, an environment's or an agent's episodes — and this package only calls them) on the draw's examples: their
collector runs where the engine is (in this process for sync and lagged, in the rollout workers for async: the
picklable episodes travel with each request), and `take` / `generate` score what comes back (`episodes.score`) in
this process, so every rollout a source returns carries its reward and its episode record.

`draw(step) -> Draw` is the trainer's prompt draw (examples, sampling parameters, and the prompt sampler's
position after it); `trained_position` is that position after the last batch `take` returned, which a
checkpoint stores (a resumed run draws any batches that were in flight again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from torch import Tensor

from dppo.rollout.base import Rollout, SamplingParams


class Episodes(Protocol):
    """The run's episodes as the sources see them (picklable: rollout workers receive them; `dppo.episodes` makes
    them, one kind per run)."""

    max_turns: int
    """Turns per episode (1 for a single answer; an agent's calls): the bound of the per-turn units and metrics."""
    max_tokens: int
    """Response tokens of a row (the longest response the trainer sees)."""

    def collector(self) -> Callable[[Any, Sequence, SamplingParams], list[Rollout]]:
        """`collect(engine, examples, params)`: params.n episodes per example, prompt-major."""
        ...

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Set every rollout's reward (and its record's reward failures) in the trainer's process."""
        ...

    def check(self, example) -> str | None:
        """Before any model loads: the episodes can run `example` (TypeError / ValueError / KeyError otherwise);
        returns their start-up line (e.g. the python tool's sandbox layer), if they have one."""
        ...

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """The step's episode metrics ({} for single answers)."""
        ...


@dataclass
class Draw:
    """The prompts of one training step."""

    examples: list
    """The task examples (rollouts' `prompt_index` indexes this list)."""
    params: SamplingParams
    position: int
    """The prompt sampler's position after this draw."""


class StalenessError(RuntimeError):
    """A source returned a response older than its staleness bound (a scheduling bug, never silently trained)."""


class RolloutSource:
    """Base of every source: the staleness check of `take` and the position bookkeeping (see the module)."""

    max_staleness: int = 0
    """The largest staleness this source can return (sync 0, lagged k, async rollout.max_staleness)."""
    engine: Any = None
    """The in-process engine, if the source has one (None for rollout workers)."""

    def __init__(self, draw: Callable[[int], Draw], *, start_position: int, episodes: Episodes) -> None:
        self.draw, self.episodes = draw, episodes
        self.trained_position = start_position

    def take(self, step: int) -> tuple[list, list[Rollout]]:
        examples, rollouts, position = self._take(step)
        old = min((r.weight_version for r in rollouts), default=step)
        if step - old > self.max_staleness or any(r.weight_version > step for r in rollouts):
            raise StalenessError(f"step {step}: a response sampled under version {old} (staleness {step - old}), "
                                 f"bound {self.max_staleness}")
        self.trained_position = position
        self.episodes.score(examples, rollouts)
        return examples, rollouts

    def generate(self, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        rollouts = self._generate(examples, params)
        self.episodes.score(examples, rollouts)
        return rollouts

    def _take(self, step: int) -> tuple[list, list[Rollout], int]:
        raise NotImplementedError

    def _generate(self, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        raise NotImplementedError

    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
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
    """The run's engines in the trainer's process (one engine, or a `dppo.rollout.fleet.FleetEngine`), engine j
    `lags[j]` versions behind the trainer (all 0 = synchronous)."""

    def __init__(self, engine, draw: Callable[[int], Draw], *, weights: dict[str, Tensor], version: int,
                 start_position: int, episodes: Episodes, lags: Sequence[int] = (0,)) -> None:
        super().__init__(draw, start_position=start_position, episodes=episodes)
        if min(lags) < 0:
            raise ValueError(f"rollout.engine_lag: expected >= 0, got {min(lags)}")
        self.engine, self.lags, self.max_staleness = engine, list(lags), max(lags)
        self.collect = episodes.collector()
        self._kept: dict[int, dict] = {}  # version -> CPU state dict a lagging engine has yet to load
        self.engine.load_weights(weights)
        self.versions = [version] * len(self.lags)  # the version each engine holds

    def _take(self, step: int):
        d = self.draw(step)
        return d.examples, self._generate(d.examples, d.params), d.position

    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        """Engine j loads version `version` - lags[j] once it is published (the newest weights at once when its lag
        is 0; a lagging engine's versions wait here, on the CPU)."""
        if self.max_staleness:
            self._kept[version] = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        due: dict[int, list[int]] = {}
        for j, lag in enumerate(self.lags):
            if version - lag > self.versions[j] and (lag == 0 or version - lag in self._kept):
                due.setdefault(version - lag, []).append(j)
        for target, members in sorted(due.items()):
            state = weights if target == version else self._kept[target]
            self.engine.load_weights(state, **({} if len(members) == len(self.lags) else {"members": members}))
            for j in members:
                self.versions[j] = target
        for old in [v for v in self._kept if v <= min(self.versions)]:
            del self._kept[old]

    def _generate(self, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        rollouts = self.collect(self.engine, examples, params)
        for version in set(self.versions):  # each response: the version its engine holds (`Rollout.engine`)
            stamp([r for r in rollouts if self.versions[r.engine] == version], version)
        return rollouts

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def close(self) -> None:
        closing = getattr(self.collect, "close", None)  # an episode collector's own servers (the agents' proxy)
        if callable(closing):
            closing()
        self.engine.close()

