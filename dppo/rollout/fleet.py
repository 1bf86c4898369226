"""Several engines as one: engines of different kinds, precisions or lags sampling one run's batch under one trust
region (`rollout.engines` with more than one engine; on the command line `--rollout.fleet
"vllm-server:bfloat16,hf:float32"`). `fleet_of(specs)` builds the run's engines as one engine (one is itself).

Each member is an ordinary engine built from its own `EngineSpec` (`dppo.rollout.spec.build_engine`: its kind's
settings node, its dtype, fp8 weights or not, its own seed). `FleetEngine` is itself an engine (the
`dppo.rollout.base.Engine` protocol):
- `generate` deals whole prompts to the members in turn (prompt i to member i mod M, so the G responses of a
  prompt come from one engine and the members' shares differ by at most one prompt), runs the members at once (a
  thread each), and returns the rollouts prompt-major as one engine would, each tagged with its member
  (`Rollout.engine` = j, logged as `engine_{j}`);
- `load_weights` gives every member (or the members named: engines whose lags differ, `dppo.rollout.source`) the
  same weights (fp8 members quantise their copy).

Why it is exact: every member records µ as the log-probs of the distribution it sampled from, so a response's
importance weight π/µ and its trust-region mask are those of the engine that sampled it, token by token, whatever
the members' numerics. The trainer splits the mismatch, the masked share and the reward by member
(`dppo.train.step_metrics`).

Limits (refused by the run config, `dppo.train.kinds.check_engines`): single answers only (an episode's turns are
separate engine calls, which would deal one episode's turns and one group's episodes to different members; under
rollout.mode async each rollout worker holds one engine instead, and runs whole episodes), at most one in-process
`vllm` engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Sequence

from dppo.rollout.base import EnginePrompt, Rollout, SamplingParams
from dppo.rollout.spec import EngineSpec, build_engine

SEED_STRIDE = 1 << 40
"""Member j samples a call seeded s with seed s + j·SEED_STRIDE (members draw independent randomness)."""


def fleet_of(specs: Sequence[EngineSpec]):
    """The engines of `specs` as one engine: one engine is itself, several a `FleetEngine` (built in order; those
    built are closed if one fails)."""
    if len(specs) == 1:
        return build_engine(specs[0])
    return FleetEngine.from_specs(specs)


class FleetEngine:
    """Several engines as one (see the module docstring). members: built engines, in fleet order (member j's
    rollouts are tagged j); they must share one tokenizer. The fleet owns them: `close` closes every one."""

    between_chunks = None
    """In-flight weight updates: a fleet has none (in-flight updates need rollout.mode async, where a worker holds one engine)."""

    def __init__(self, members: Sequence) -> None:
        if not members:
            raise ValueError("members: expected at least one engine")
        self.members = list(members)
        self.tokenizer = self.members[0].tokenizer
        vocab = _vocab(self.tokenizer)
        for j, member in enumerate(self.members[1:], 1):
            if _vocab(member.tokenizer) != vocab:
                self.close()
                raise ValueError(f"rollout.engines: engine_{j}'s tokenizer differs from engine_0's (every member "
                                 f"serves the trainer's model)")
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self.members), thread_name_prefix="dppo-fleet")

    @classmethod
    def from_specs(cls, specs: Sequence[EngineSpec]) -> "FleetEngine":
        """The fleet of one engine per spec (`build_engine`); the members built so far are closed if one fails."""
        members = []
        try:
            for spec in specs:
                members.append(build_engine(spec))
        except BaseException:
            _close_all(members)
            raise
        return cls(members)

    # --- the Engine protocol -------------------------------------------------------------------------------

    @property
    def max_logprobs(self) -> int:
        return min(m.max_logprobs for m in self.members)

    @property
    def weight_version(self) -> int:
        return min(m.weight_version for m in self.members)

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        for member in self.members:
            member.weight_version = version

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        """Sample `params.n` responses per prompt, prompt i on member i mod M; returns len(prompts) * n rollouts,
        prompt-major, each tagged with its member (`Rollout.engine`)."""
        M = len(self.members)
        shares = [(j, list(range(j, len(prompts), M))) for j in range(M)]
        shares = [(j, idx) for j, idx in shares if idx]  # (fewer prompts than members: the last ones sit out)

        def sample(j: int, idx: list[int]) -> list[Rollout]:
            seed = None if params.seed is None else params.seed + j * SEED_STRIDE
            return self.members[j].generate([prompts[i] for i in idx], dataclasses.replace(params, seed=seed))

        results = self._all(sample, shares)
        rollouts = []
        for (j, idx), got in zip(shares, results):
            if len(got) != len(idx) * params.n:
                raise RuntimeError(f"engine_{j}: returned {len(got)} rollouts for {len(idx)} prompts x {params.n}")
            for r in got:
                r.prompt_index, r.engine = idx[r.prompt_index], j
            rollouts += got
        return sorted(rollouts, key=lambda r: r.prompt_index)  # stable: each prompt's n keep their order

    def load_weights(self, weights, members: Sequence[int] | None = None) -> None:
        """Every member (or those of `members`, engines whose lags differ) loads `weights` (a state dict with HF
        names, or a module), all at once."""
        chosen = range(len(self.members)) if members is None else members
        self._all(lambda j, _: self.members[j].load_weights(weights), [(j, None) for j in chosen])

    def enable_prefix_cache(self, max_tokens: int) -> None:
        for member in self.members:
            member.enable_prefix_cache(max_tokens)

    def metrics(self) -> dict[str, float]:
        """The members' own counters (`Engine.metrics`: e.g. a vllm-server member's server faults), as
        `engine_{j}/<name>`."""
        return {f"engine_{j}/{k}": v for j, member in enumerate(self.members) for k, v in member.metrics().items()}

    def close(self) -> None:
        """Close every member (all of them, even when one raises; the first error is raised after)."""
        pool = vars(self).get("_pool")
        if pool is not None:
            pool.shutdown(wait=True)
        _close_all(self.members)

    def _all(self, fn, jobs: list[tuple[int, object]]) -> list:
        """fn(j, arg) for every (j, arg) of `jobs` at once, each on its own thread; their results in order. Waits
        for every one before raising the first error (noted with its member)."""
        futures = [self._pool.submit(fn, j, arg) for j, arg in jobs]
        cf.wait(futures)
        for (j, _), future in zip(jobs, futures):
            exc = future.exception()
            if exc is not None:
                exc.add_note(f"(in rollout.engines' engine_{j})")
                raise exc
        return [f.result() for f in futures]


def _vocab(tokenizer):
    get = getattr(tokenizer, "get_vocab", None)
    return get() if callable(get) else None


def _close_all(engines: Sequence) -> None:
    first = None
    for engine in engines:
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - the others are closed first, then it is raised
            first = first or exc
    if first is not None:
        raise first
