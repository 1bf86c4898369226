"""Episodes, token in, token out: an environment's turns around an engine, each episode one scored `Rollout`.

Every rollout a `RolloutSource` returns is an episode of the run's environment (`Episodes`, picklable: rollout
workers receive it), collected by `env.collector()` wherever the engine is and scored by `env.score` in the
trainer's process:

- `SingleTurnEnv(max_tokens, reward=runner)`: a single answer as a one-turn episode — the task's prompt, one
  reply, the task's reward. The whole batch is ONE engine call (params.n answers per prompt) and ONE reward-runner call.
- `EpisodeSpec(env, options, max_turns=..., max_tokens=..., env_timeout_s=...)`: multi-turn episodes of an
  `dppo.envs` environment, scored by the environment turn by turn while they run (`EpisodeCollector`).

    rollouts = env.collector()(engine, examples, params)    # params.n episodes per example, prompt-major
    env.score(examples, rollouts)                            # every rollout's `reward` and `episode` record set
    rewards, stats = episode_rewards(rollouts)               # what the trainer and the evaluation read
    env.metrics(rollouts)                                    # the step's episode/* metrics ({} for single-turn)

The limits' defaults (turns, tokens, timeout) live in one place, the run config's `EnvConfig`.

**Multi-turn episodes.** Layout of one episode (one `Rollout`; P = the first prompt's ids, rendered once by the
chat template):

    prompt_ids    | P = <|im_start|>system ... <|im_start|>user ... <|im_start|>assistant\\n
    response_ids  | g1 ... <|im_end|> | \\n <|im_start|>tool\\n ... <|im_end|>\\n<|im_start|>assistant\\n | g2 ... <|im_end|>
    loss_mask     | 1  ...  1         | 0 ..................................................... 0  | 1  ...  1
    rollout_logp  | log µ(g_t)        | 0                                                        | log µ(g_t)
    token_versions| version of g_t    | (the previous token's)                                   | ...
    turn_index    | 0                 | 0 (answers to turn 0)                                    | 1

- **The engine's ids are kept.** Each turn samples from the episode's ids so far (a token-id prompt), so the ids
  trained are exactly the ids sampled, with µ (and µ's top-K cells) recorded by the engine on every generated token.
  Environment messages are tokenised alone, as the suffix difference of the chat template's rendering of a fixed
  synthetic conversation with and without them (`ChatDelta`); the template's boundary tokens after the stop token
  (ChatML's `\\n` after `<|im_end|>`) are inserted with mask 0. Nothing is ever re-tokenised, so the cost per turn
  is the appended text only, and what the template would render for the whole transcript is checked in the tests.
  Because each turn's prompt is exactly the previous turn's ids plus new ones, the hf engine's prefix cache
  (enabled for the episodes of a call) prefills only the new tokens: the KV of earlier turns is reused.
- A template whose rendering of earlier messages changes when a message is appended (one that rewrites history)
  cannot be extended this way: `ChatDelta` refuses it by name at start, before any model runs.
- Environment tokens have `loss_mask` 0, `rollout_logp` 0 and µ's top-K cells invalid; the trainer counts only
  generated tokens in the loss, its denominator, the advantages' token counts and every metric.
- Budgets: `max_turns` assistant turns; `max_tokens` response tokens for the whole episode (each turn's
  max_new_tokens is the smaller of the per-turn cap and what is left); an episode that would exceed them is
  truncated (`finish_reason` "length"), never an error. A turn cut by its max_new_tokens is answered like any
  other (the environment sees the cut reply, counted in `turns_truncated`); the template's end-of-turn that the
  engine did not sample (the stop token, then the boundary) is inserted as environment tokens, mask 0, so the
  transcript stays well-formed and no token the policy did not sample is ever trained.
- An environment that raises, hangs (`env_timeout_s`) or returns a malformed step is contained: the episode ends
  with the rewards earned so far and the error is counted under the environment's name (`Rollout.episode`).
  Resets and steps run through `dppo.runtime.bounded.bounded_calls`.
- Versions: each token records the weight version that sampled it; an episode's `weight_version` is its
  **oldest** generated token's, so its staleness is that of its stalest token. With in-flight updates (an async
  worker's `engine.between_chunks`), newer weights are also taken between turns, so an episode may span versions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from dppo.envs import make_environment
from dppo.envs.base import check_messages, check_step
from dppo.envs.tools import render_messages_with_tools, template_supports_tools, tool_schema
from dppo.rollout.base import EnginePrompt, Episode, Rollout, SamplingParams
from dppo.runtime.bounded import bounded_calls

_TURN_SEED_MULT = 0x5851F42D4C957F2D


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn`: (seed + turn·m) mod 2^62 with m odd, so no turn's seed is another async
    share's (which adds 2^40) or another rank's (2^32)."""
    return None if seed is None else (seed + turn * _TURN_SEED_MULT) % (1 << 62)


_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


class Episodes(Protocol):
    """The run's environment as the sources see it (picklable; see the module docstring)."""

    max_turns: int
    """Assistant turns per episode (1 for a single answer)."""
    max_tokens: int
    """Response tokens of a whole episode (the longest response the trainer sees)."""

    def collector(self) -> Callable[[Any, Sequence, SamplingParams], list[Rollout]]:
        """`collect(engine, examples, params)`: params.n episodes per example, prompt-major."""
        ...

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Set every rollout's reward (and its record's reward failures) in the trainer's process."""
        ...

    def check(self, example) -> str | None:
        """Before any model loads: the environment answers `example` (TypeError / ValueError / KeyError otherwise);
        returns its start-up line (e.g. the python tool's sandbox layer), if it has one."""
        ...

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """The step's episode metrics."""
        ...


def engine_prompts(examples, tokenizer) -> list[EnginePrompt]:
    """What the engine takes for a single answer: chat messages as they are, raw-text prompts as token ids (no
    template)."""
    return [list(tokenizer.encode(ex.prompt, add_special_tokens=False)) if isinstance(ex.prompt, str)
            else list(ex.prompt) for ex in examples]


@dataclass
class SingleTurnEnv:
    """A single answer as a one-turn episode: the task's prompt (`engine_prompts`), one reply of up to `max_tokens`
    tokens, scored by the task's reward. The batch is one `engine.generate` call (params.n answers per prompt) and
    one call of `reward` (a `dppo.rewards.RewardRunner`: a reward that raises or times out gives 0.0, counted in
    the record's env_errors / env_timeouts; a non-finite one raises `NonFiniteRewardError`). Pickled without its
    reward: a rollout worker only collects."""

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
            raise RuntimeError("SingleTurnEnv.score: no reward runner (a pickled copy only collects)")
        rewards, _ = self.reward([r.episode.completion for r in rollouts], [examples[r.prompt_index] for r in rollouts])
        for r, value, status in zip(rollouts, rewards.tolist(), self.reward.last_status):
            r.reward = value
            r.episode.env_errors, r.episode.env_timeouts = float(status == "failure"), float(status == "timeout")

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        return {}

    def check(self, example) -> str | None:
        return None


COUNTERS = ("turns", "turns_truncated", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated")
"""Per-episode counters reported as means per episode (`episode/<name>_mean`)."""


@dataclass(frozen=True)
class EpisodeSpec:
    """Multi-turn episodes of an environment (picklable: rollout workers receive it). The limits have no defaults
    here: the run config's `EnvConfig` owns them (and checks them)."""

    env: str
    """An environment name (`dppo.envs.ENVIRONMENTS`) or import path."""
    options: dict = field(default_factory=dict)
    """The environment's keyword options."""
    max_turns: int = field(kw_only=True)
    """Assistant turns per episode."""
    max_tokens: int = field(kw_only=True)
    """Response tokens of a whole episode (generated and environment tokens after the first prompt)."""
    env_timeout_s: float = field(kw_only=True)
    """Longest an environment's reset or step may take; past it the episode ends, counted as an env timeout."""

    def factory(self):
        return make_environment(self.env, **self.options)

    def collector(self) -> "EpisodeCollector":
        return EpisodeCollector(self)

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Nothing to do: the environment scored each episode while it ran (the sum of its turns' rewards)."""

    def check(self, example) -> str | None:
        env = self.factory()()
        check_messages(env.reset(example), self.env)
        line = getattr(env, "start_line", None)  # (any class with reset and step is an environment)
        return line() if callable(line) else None

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Counters per episode, truncated share, the share of environment tokens among the response tokens, and
        the environment's errors and timeouts (totals)."""
        n = len(rollouts)
        eps = [r.episode for r in rollouts]
        tokens = sum(int(r.response_ids.numel()) for r in rollouts)
        out = {f"episode/{k}_mean": sum(getattr(e, k) for e in eps) / n for k in COUNTERS}
        out["episode/truncated_frac"] = sum(e.truncated for e in eps) / n
        out["episode/env_token_frac"] = sum(e.env_tokens for e in eps) / max(tokens, 1)
        out["episode/generated_tokens_mean"] = (tokens - sum(e.env_tokens for e in eps)) / n
        out["episode/env_errors"] = float(sum(e.env_errors for e in eps))
        out["episode/env_timeouts"] = float(sum(e.env_timeouts for e in eps))
        return out


def first_rows(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """Each episode's first row (`Rollout.row` 0): the episodes, in order (one per rollout but for an agent's
    multi-row episodes)."""
    return [r for r in rollouts if r.row == 0]


def row_episodes(rollouts: Sequence[Rollout]) -> Tensor:
    """[B] int64: the episode (index into `first_rows`) of each row. ValueError when the first rollout is not a first
    row (an episode's rows follow its first)."""
    if rollouts and rollouts[0].row != 0:
        raise ValueError("rollouts: the first rollout is not its episode's first row (Rollout.row 0)")
    return torch.cumsum(torch.tensor([r.row == 0 for r in rollouts], dtype=torch.long), 0) - 1


def episode_rewards(rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, int]]:
    """[E] float32 rewards of the scored episodes (`first_rows`) and the step's reward counts (failures: the
    environment or the reward raised; timeouts). ValueError for an unscored episode or a non-finite reward."""
    episodes = first_rows(rollouts)
    missing = [i for i, r in enumerate(episodes) if r.reward is None]
    if missing:
        raise ValueError(f"rollouts: {len(missing)} responses were not scored by their environment, e.g. #{missing[0]}")
    out = torch.tensor([float(r.reward) for r in episodes], dtype=torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("rollouts: an environment returned a non-finite reward")
    return out, {"failures": int(sum(r.episode.env_errors for r in episodes)),
                 "timeouts": int(sum(r.episode.env_timeouts for r in episodes))}


SUCCESS_REWARD = 1.0
"""An episode without the environment's own verdict succeeded when its reward reached this (to 1e-6)."""


def episode_success(rollouts: Sequence[Rollout], rewards: Tensor) -> Tensor:
    """[E] bool: whether each scored episode (`first_rows`) succeeded — the environment's verdict where it gave one
    (`Episode.success`, from `EnvStep.info["success"]`), else reward >= SUCCESS_REWARD. pass@1 and
    `reward/accuracy` are its mean, in evaluation and in training alike; the mean reward is reported beside it."""
    verdict = torch.tensor([r.episode.success for r in first_rows(rollouts)], dtype=torch.float32)
    return torch.where(torch.isnan(verdict), rewards >= SUCCESS_REWARD - 1e-6, verdict > 0.5)


class ChatDelta:
    """Token ids of appended messages, without re-rendering the transcript (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tools_in_template = template_supports_tools(tokenizer)
        eos = tokenizer.eos_token_id
        self.base = self._render(_BASE, generation_prompt=False)
        ends = [i for i, t in enumerate(self.base) if t == eos]
        if not ends:
            raise ValueError("tokenizer: its chat template does not end an assistant message with the EOS token "
                             f"{tokenizer.eos_token!r}; token-in-token-out episodes need it")
        self.boundary = self.base[ends[-1] + 1:]
        """Template tokens after an assistant message's stop token (ChatML: the newline), inserted with mask 0."""
        probe = self._render(_BASE + [{"role": "user", "content": "V"}, {"role": "assistant", "content": "B"}],
                             generation_prompt=False)
        if probe[:len(self.base)] != self.base:
            raise ValueError("tokenizer: its chat template rewrites earlier messages when one is appended, so an "
                             "episode cannot keep the sampled ids; token-in-token-out episodes need a template "
                             "that only appends")

    def _render(self, messages, *, generation_prompt: bool, tools=None) -> list[int]:
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                 tokenize=True, tools=tools)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def prompt(self, messages, schemas: list[dict]) -> list[int]:
        """The first prompt's ids: `messages` with the tools (through the template, or in the system prompt)."""
        if not schemas:
            return self._render(messages, generation_prompt=True)
        if self.tools_in_template:
            return self._render(messages, generation_prompt=True, tools=schemas)
        return self._render(render_messages_with_tools(self.tokenizer, messages, schemas), generation_prompt=True)

    def suffix(self, messages) -> list[int]:
        """Ids of `messages` appended after an assistant turn, up to the next generation prompt (boundary excluded)."""
        full = self._render(_BASE + list(messages), generation_prompt=True)
        if full[:len(self.base)] != self.base:
            raise ValueError("tokenizer: the chat template rewrote earlier messages when environment messages were "
                             "appended; token-in-token-out episodes need a template that only appends")
        return full[len(self.base):]


class TokenRecord:
    """A growing row of tokens after a prompt: generated tokens (mask 1, µ, µ's top-K cells, versions) and inserted
    environment tokens (mask 0, µ 0, cells invalid, the previous token's version), each tagged with its turn. An
    episode is one record; an agent's episode through the proxy may be several (`dppo.agents.rows`)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.mask: list[bool] = []
        self.turn: list[int] = []
        self.versions: list[int] = []
        self.cells: list = []  # per part: (ids [t, S], logp, valid) of generated tokens, or an env part's length

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_generated(self, r: Rollout, turn: int) -> None:
        n = int(r.response_ids.numel())
        self.ids += r.response_ids.tolist()
        self.logp += r.rollout_logp.tolist()
        self.mask += [True] * n
        self.turn += [turn] * n
        versions = r.token_versions if r.token_versions is not None else torch.full((n,), r.weight_version)
        self.versions += versions.tolist()
        self.cells.append((r.rollout_topk_ids, r.rollout_topk_logp, r.rollout_topk_valid) if r.rollout_topk_ids is not None else n)

    def add_env(self, ids: list[int], turn: int) -> None:
        self.ids += ids
        self.logp += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.turn += [turn] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.cells.append(len(ids))

    def to_rollout(self, prompt_index: int, finish: str, **fields) -> Rollout:
        """The record as a `Rollout` (its weight version: the oldest generated token's); `fields` go to it."""
        mask = torch.tensor(self.mask, dtype=torch.bool)
        versions = torch.tensor(self.versions, dtype=torch.long)
        out = Rollout(prompt_index=prompt_index, prompt_ids=torch.tensor(self.prompt_ids, dtype=torch.long),
                      response_ids=torch.tensor(self.ids, dtype=torch.long),
                      rollout_logp=torch.tensor(self.logp, dtype=torch.float32), finish_reason=finish,
                      weight_version=int((versions[mask] if bool(mask.any()) else versions).min()),
                      token_versions=versions, loss_mask=mask, turn_index=torch.tensor(self.turn, dtype=torch.long),
                      **fields)
        widths = [c[0].shape[-1] for c in self.cells if isinstance(c, tuple)]
        if widths:  # µ's top-K cells of generated tokens; invalid (id 0, log-prob 0) on environment tokens
            S = widths[0]
            parts = [c if isinstance(c, tuple) else (torch.zeros((c, S), dtype=torch.long),
                                                     torch.zeros((c, S)), torch.zeros((c, S), dtype=torch.bool))
                     for c in self.cells]
            out.rollout_topk_ids, out.rollout_topk_logp, out.rollout_topk_valid = (torch.cat(p) for p in zip(*parts))
        return out


class _Episode(TokenRecord):
    """One episode's growing token record and transcript."""

    def __init__(self, prompt_index: int, env, prompt_ids: list[int], messages: list[dict]) -> None:
        super().__init__(prompt_ids)
        self.prompt_index, self.env, self.messages = prompt_index, env, messages
        self.reward, self.turns, self.done, self.finish = 0.0, 0, False, "eos"
        self.stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "tool_truncated": 0.0,
                      "env_errors": 0.0, "env_timeouts": 0.0, "truncated": 0.0, "turns_truncated": 0.0}
        self.stopped = True  # whether the last turn ended with the engine's stop token
        self.error: str | None = None
        self.success = math.nan  # the environment's own verdict, if it gives one (EnvStep.info["success"])

    def end(self, finish: str, error: str | None = None) -> None:
        self.done, self.finish = True, finish
        if finish == "length":
            self.stats["truncated"] = 1.0
        if error is not None:
            self.error = error

    def rollout(self) -> Rollout:
        text = transcript(self.messages) + (f"\n<error> {self.error}" if self.error else "")
        episode = Episode(completion=text, messages=self.messages, error=self.error, turns=float(self.turns),
                          env_tokens=float(self.mask.count(False)), success=self.success, **self.stats)
        return self.to_rollout(self.prompt_index, self.finish, reward=self.reward, episode=episode)


class EpisodeCollector:
    """Runs `params.n` episodes per example on an engine, all episodes' turns batched into one engine call per turn.

    Picklable (it holds the spec; the environment factory and the `ChatDelta` are built in the process that runs it).
    """

    def __init__(self, spec: EpisodeSpec) -> None:
        self.spec = spec
        self._factory = None
        self._delta: ChatDelta | None = None

    def __getstate__(self):
        return {"spec": self.spec}

    def __setstate__(self, state) -> None:
        self.__init__(state["spec"])

    def __call__(self, engine, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        spec = self.spec
        if self._factory is None:
            self._factory, self._delta = spec.factory(), ChatDelta(engine.tokenizer)
        episodes = []
        for p, example in enumerate(examples):
            for _ in range(params.n):
                env = self._factory()
                [reset] = bounded_calls([lambda: env.reset(example)], spec.env_timeout_s, name="dppo-env")
                if reset.status != "ok":
                    raise ValueError(f"environment {spec.env!r}: reset() failed on example {example.uid}: "
                                     f"{'timed out' if reset.status == 'timeout' else repr(reset.error)}")
                messages = check_messages(reset.value, spec.env)
                schemas = [tool_schema(fn) for fn in getattr(env, "tools", ())]  # (any class with reset and step)
                episodes.append(_Episode(p, env, self._delta.prompt(messages, schemas), messages))
        # (the hf engine: later turns prefill only their new tokens; a no-op for engines without the cache)
        engine.enable_prefix_cache(sum(len(ep.prompt_ids) + spec.max_tokens for ep in episodes))
        try:
            for turn in range(spec.max_turns):
                active = [ep for ep in episodes if not ep.done]
                if not active:
                    break
                self._turn(engine, active, params, turn)
        finally:
            engine.enable_prefix_cache(0)
        for ep in episodes:
            if not ep.done:  # max_turns reached without the environment ending it
                ep.end("length")
        return [ep.rollout() for ep in episodes]

    def _turn(self, engine, active: list[_Episode], params: SamplingParams, turn: int) -> None:
        spec = self.spec
        left = [spec.max_tokens - len(ep.ids) for ep in active]
        for ep, room in zip(active, left):
            if room < 1:
                ep.end("length")
        active = [ep for ep, room in zip(active, left) if room >= 1]
        if not active:
            return
        max_new = min(params.max_new_tokens, max(spec.max_tokens - len(ep.ids) for ep in active))
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=max_new,
                                          seed=turn_seed(params.seed, turn))
        if turn > 0 and engine.between_chunks is not None:  # in-flight updates: newer weights between turns too
            engine.between_chunks()
        rollouts = engine.generate([ep.context() for ep in active], turn_params)
        for ep, r in zip(active, rollouts):
            room = spec.max_tokens - len(ep.ids)
            if r.response_ids.numel() > room:  # (episodes with less room than the batch's longest turn)
                r = _cut(r, room)
            ep.add_generated(r, ep.turns)
            ep.turns += 1
            reply = self._delta.tokenizer.decode(r.response_ids.tolist(), skip_special_tokens=True)
            ep.messages.append({"role": "assistant", "content": reply})
            # the template ends an assistant turn with the tokenizer's EOS: a turn cut by max_new_tokens, or ended by
            # another stop id, gets it inserted (mask 0) before the boundary
            ep.stopped = bool(r.response_ids.numel()) and int(r.response_ids[-1]) == self._delta.tokenizer.eos_token_id
            ep.stats["turns_truncated"] += float(r.finish_reason == "length")
        self._answer([ep for ep in active if not ep.done])

    def _answer(self, episodes: list[_Episode]) -> None:
        """Every episode's environment answers its last reply (in parallel threads; each call bounded in time)."""
        spec = self.spec
        results = bounded_calls([lambda ep=ep: check_step(ep.env.step(ep.messages[-1]["content"]), spec.env)
                                 for ep in episodes], spec.env_timeout_s, name="dppo-env")
        for ep, outcome in zip(episodes, results):
            status, value = outcome.status, outcome.value if outcome.status == "ok" else outcome.error
            if status == "timeout":
                ep.stats["env_timeouts"] += 1
                ep.end("eos", f"environment {spec.env!r}: step() timed out after {spec.env_timeout_s:g}s")
                continue
            if status == "error":
                ep.stats["env_errors"] += 1
                ep.end("eos", f"environment {spec.env!r}: {type(value).__name__}: {value}")
                continue
            step = value
            ep.reward += float(step.reward)
            for key, v in step.info.items():
                if key in ep.stats:
                    ep.stats[key] += float(v)
            if "success" in step.info:  # a verdict, not a counter: the last one given stands
                ep.success = float(bool(step.info["success"]))
            if step.done:
                ep.end("eos")
                continue
            ids = ([] if ep.stopped else [self._delta.tokenizer.eos_token_id]) + self._delta.boundary \
                + self._delta.suffix(step.messages)
            if ep.turns >= spec.max_turns or len(ep.ids) + len(ids) >= spec.max_tokens:
                ep.end("length")  # no room for the environment's answer and another turn
                continue
            ep.messages.extend(dict(m) for m in step.messages)
            ep.add_env(ids, ep.turns - 1)  # (the turn it answers)


def _cut(r: Rollout, n: int) -> Rollout:
    """The first n tokens of a rollout (a turn longer than its episode's remaining budget), finish "length"."""
    cut = lambda t: None if t is None else t[:n]  # noqa: E731
    return dataclasses.replace(r, response_ids=r.response_ids[:n], rollout_logp=r.rollout_logp[:n],
                               token_versions=cut(r.token_versions), rollout_topk_ids=cut(r.rollout_topk_ids),
                               rollout_topk_logp=cut(r.rollout_topk_logp), rollout_topk_valid=cut(r.rollout_topk_valid),
                               finish_reason="length")


def transcript(messages: list[dict]) -> str:
    """A whole episode as text for the samples file; the environment's messages (every non-assistant message after
    the first assistant turn) are marked `[env]`."""
    lines, replied = [], False
    for m in messages:
        replied |= m["role"] == "assistant"
        mark = " [env]" if replied and m["role"] != "assistant" else ""
        lines.append(f"<{m['role']}{mark}> {m['content']}")
    return "\n".join(lines)


__all__ = ["COUNTERS", "ChatDelta", "TokenRecord", "EpisodeCollector", "EpisodeSpec", "Episodes", "SingleTurnEnv", "engine_prompts",
           "episode_rewards", "episode_success", "first_rows", "row_episodes", "transcript", "turn_seed", "SUCCESS_REWARD"]
