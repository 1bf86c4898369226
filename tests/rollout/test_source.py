"""dppo.rollout.source: every source stamps the published version that sampled each rollout, `take` checks the
staleness bound in one place, and what `take` and `generate` return is scored by the run's environment. The engine
and the environment here are stand-ins that record what they were given (the source is under test, not the engine
nor the episodes); the real engines and environments go through the same source in tests/train/test_trainer.py,
test_fp8_lag.py, test_episodes.py and test_async.py."""

from __future__ import annotations

import pytest
import torch

from dppo.rollout.base import Rollout, SamplingParams
from dppo.rollout.source import Draw, EngineSource, RolloutSource, StalenessError, stamp


class _Engine:
    """Answers every prompt with one token; its answer names the weights it holds (weights["w"])."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def load_weights(self, weights) -> None:
        self.loaded.append(float(weights["w"]))

    def generate(self, prompts, params):
        w = self.loaded[-1]
        return [Rollout(i, torch.tensor([1]), torch.tensor([int(w)]), torch.zeros(1), "eos",
                        weight_version=-99, token_versions=torch.full((1,), -99))
                for i in range(len(prompts)) for _ in range(params.n)]

    def close(self) -> None:
        pass


class _Episodes:
    """One response per sample from the engine's `generate`; scored in the source's process with reward = the
    response's token (so a test sees that `score` ran on what the collector returned)."""

    max_turns, max_tokens = 1, 1

    def __init__(self) -> None:
        self.scored: list[list] = []

    def collector(self):
        return lambda engine, examples, params: engine.generate(examples, params)

    def score(self, examples, rollouts) -> None:
        self.scored.append(list(examples))
        for r in rollouts:
            r.reward = float(r.response_ids[0])

    def metrics(self, rollouts) -> dict:
        return {}


def _draw(step: int) -> Draw:
    return Draw([f"example {step}"], SamplingParams(n=2, max_new_tokens=1), position=10 * (step + 1))


def _weights(version: int) -> dict:
    return {"w": torch.tensor(float(version))}


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_engine_gets_version_v_once_v_plus_lag_is_published_and_every_rollout_names_it(lag):
    engine, episodes = _Engine(), _Episodes()
    source = EngineSource(engine, _draw, weights=_weights(0), version=0, start_position=0, lags=[lag], episodes=episodes)
    assert source.max_staleness == lag
    for step in range(8):
        examples, rollouts = source.take(step)
        held = max(0, step - lag)  # the newest version the engine may hold at step s
        assert examples == [f"example {step}"] and source.trained_position == 10 * (step + 1)
        assert {r.weight_version for r in rollouts} == {held}  # stamped with the published version ...
        assert all(int(r.response_ids[0]) == held for r in rollouts)  # ... which is the one that sampled it
        assert all(r.token_versions.tolist() == [held] for r in rollouts)
        assert episodes.scored[-1] == examples and [r.reward for r in rollouts] == [float(held)] * 2  # scored
        source.publish(step + 1, _weights(step + 1))
    assert engine.loaded == [float(v) for v in range(0, 8 - lag + 1)]
    [r] = source.generate(["held out"], SamplingParams())
    assert r.weight_version == 8 - lag and r.reward == float(8 - lag)  # evaluation: the same weights, scored
    assert episodes.scored[-1] == ["held out"]


def test_a_lagged_source_keeps_copies_not_the_trainers_tensors():
    engine = _Engine()
    source = EngineSource(engine, _draw, weights=_weights(0), version=0, start_position=0, lags=[1], episodes=_Episodes())
    live = _weights(1)
    source.publish(1, live)
    live["w"].fill_(123.0)  # the trainer updates its weights in place
    source.publish(2, _weights(2))
    assert engine.loaded == [0.0, 1.0]


def test_engines_of_different_lags_each_hold_their_own_version_and_stamp_their_own_responses():
    """Two engines as one (`FleetEngine`), lags [0, 2]: engine 0 holds each version as it is published, engine 1 the
    one two behind; each response is stamped with its engine's version (the one that sampled it), the source's bound
    is the larger lag, and only the versions a lagging engine still needs are kept."""
    from dppo.rollout.fleet import FleetEngine

    class _Tagged(_Engine):
        tokenizer = None
        max_logprobs = 1

    fresh, stale = _Tagged(), _Tagged()
    fleet = FleetEngine([fresh, stale])
    def draw(step):  # two prompts: one per engine
        return Draw([f"a {step}", f"b {step}"], SamplingParams(n=2, max_new_tokens=1), position=step + 1)

    source = EngineSource(fleet, draw, weights=_weights(0), version=0, start_position=0, lags=[0, 2],
                          episodes=_Episodes())
    try:
        assert source.max_staleness == 2
        for step in range(6):
            _, rollouts = source.take(step)
            want = {0: step, 1: max(0, step - 2)}
            assert {(r.engine, r.weight_version) for r in rollouts} == set(want.items())
            assert all(int(r.response_ids[0]) == want[r.engine] for r in rollouts)  # sampled by that version
            source.publish(step + 1, _weights(step + 1))
            assert sorted(source._kept) == list(range(max(1, step), step + 2))  # (what engine 1 has yet to load)
        assert fresh.loaded == [float(v) for v in range(7)] and stale.loaded == [float(v) for v in range(5)]
    finally:
        fleet.close()


def test_a_lagged_rollout_worker_holds_back_each_version_and_loads_the_first_at_once(monkeypatch):
    """An async worker whose engine has lag 2 (`WorkerCore`): the first published weights at once (the run's start
    or its resume), then version v once v + 2 is given; a skipped version does not stall it (it takes the newest it
    may hold)."""
    from dppo.rollout.remote import worker
    from dppo.rollout.spec import EngineSpec

    built = _Engine()
    monkeypatch.setattr(worker, "build_engine", lambda spec: built)
    core = worker.WorkerCore(EngineSpec(model=None, lag=2, index=1), 0, 1)
    for version in (5, 6, 7, 8, 10, 11):
        core.load(version, _weights(version))
    assert built.loaded == [5.0, 6.0, 8.0] and core.version == 8 and core.published == 11
    assert sorted(core._kept) == [10, 11]
    assert core.engine_index == 1


class _Stale(RolloutSource):
    """A source whose rollouts are sampled under fixed versions (a scheduling bug to be caught)."""

    def __init__(self, versions, bound):
        super().__init__(_draw, start_position=0, episodes=_Episodes())
        self.versions, self.max_staleness = versions, bound

    def _take(self, step):
        rollouts = [Rollout(0, torch.tensor([1]), torch.tensor([1]), torch.zeros(1), "eos", weight_version=v)
                    for v in self.versions]
        return [], rollouts, 5


def test_take_refuses_a_response_older_than_the_bound_or_from_the_future():
    assert len(_Stale([3, 2], bound=1).take(3)[1]) == 2  # staleness 0 and 1: within the bound
    with pytest.raises(StalenessError, match=r"^step 3: a response sampled under version 1 \(staleness 2\), bound 1"):
        _Stale([3, 1], bound=1).take(3)
    with pytest.raises(StalenessError):
        _Stale([4], bound=1).take(3)  # a version not yet published at step 3
    source = _Stale([0], bound=0)
    with pytest.raises(StalenessError):
        source.take(1)
    assert source.trained_position == 0  # a refused batch does not move the checkpointed position


def test_stamp_keeps_per_token_versions_recorded_during_in_flight_updates():
    r = Rollout(0, torch.tensor([1]), torch.tensor([1, 2]), torch.zeros(2), "eos", token_versions=torch.tensor([4, 5]))
    stamp([r], 4, in_flight=True)
    assert r.weight_version == 4 and r.token_versions.tolist() == [4, 5]
    stamp([r], 6)
    assert r.token_versions.tolist() == [6, 6]
