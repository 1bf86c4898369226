"""Multi-turn episodes of an environment (`dppo.envs`), token in, token out: each episode one scored `Rollout`.

    episodes = EnvSettings(name, ...).episodes(...)   # `EnvEpisodes`: picklable, rollout workers receive it
    rollouts = episodes.collector()(engine, examples, params)   # params.n episodes per example, prompt-major
    episodes.metrics(rollouts)                                  # the step's episode/* metrics

The environment scores each episode turn by turn while it runs (the sum of its turns' rewards). Layout of one
episode (P = the first prompt's ids, rendered once by the chat template):

    prompt_ids    | P = <|im_start|>system ... <|im_start|>user ... <|im_start|>assistant\\n
    response_ids  | g1 ... <|im_end|> | \\n <|im_start|>tool\\n ... <|im_end|>\\n<|im_start|>assistant\\n | g2 ... <|im_end|>
    loss_mask     | 1  ...  1         | 0 ..................................................... 0  | 1  ...  1
    rollout_logp  | log µ(g_t)        | 0                                                        | log µ(g_t)
    token_versions| version of g_t    | (the previous token's)                                   | ...
    turn_index    | 0                 | 0 (answers to turn 0)                                    | 1

- **The engine's ids are kept.** Each turn samples from the episode's ids so far (a token-id prompt), so the ids
  trained are exactly the ids sampled, with µ (and µ's top-K cells) recorded by the engine on every generated token
  (`dppo.episodes.records.TokenRecord`). Environment messages are tokenised alone, appended to a fixed synthetic
  conversation (`dppo.episodes.chat.ChatCodec.append`), with the template's boundary after the stop token inserted
  with mask 0. Nothing is ever re-tokenised, so the cost per turn is the appended text only. Because each turn's
  prompt is exactly the previous turn's ids plus new ones, the hf engine's prefix cache (enabled for the episodes
  of a call) prefills only the new tokens: the KV of earlier turns is reused.
- A template whose rendering of earlier messages changes when a message is appended (one that rewrites history)
  cannot be extended this way: the codec refuses it by name at start, before any model runs.
- Environment tokens have `loss_mask` 0, `rollout_logp` 0 and µ's top-K cells invalid; the trainer counts only
  generated tokens in the loss, its denominator, the advantages' token counts and every metric.
- Budgets: `max_turns` assistant turns; `max_tokens` response tokens for the whole episode (each turn's
  max_new_tokens is the smaller of the per-turn cap and what is left); an episode that would exceed them is
  truncated (`finish_reason` "length"), never an error. A turn cut by its max_new_tokens is answered like any
  other (the environment sees the cut reply, counted in `turns_truncated`); the template's end-of-turn that the
  engine did not sample (the stop token, then the boundary) is inserted as environment tokens, mask 0, so the
  transcript stays well-formed and no token the policy did not sample is ever trained.
- An environment that raises, hangs (`timeout_s`) or returns a malformed step is contained: the episode ends
  with the rewards earned so far and the error is counted under the environment's name (`Rollout.episode`).
  Resets and steps run through `dppo.runtime.bounded.bounded_calls`.
- An episode's environment is closed (`close()`, when it has one) once, as soon as the episode ends, however it
  ends: done, an error, a timeout, truncated, or the collection stopped by a failed reset or the engine. Closes run
  in parallel, bounded by `timeout_s`; one that raises or hangs is ignored.
- Versions: each token records the weight version that sampled it; an episode's `weight_version` is its
  **oldest** generated token's, so its staleness is that of its stalest token. With in-flight updates (an async
  worker's `engine.between_chunks`), newer weights are also taken between turns, so an episode may span versions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from dppo.envs import make_environment
from dppo.envs.base import check_messages, check_step
from dppo.envs.tools import tool_schema
from dppo.episodes.chat import ChatCodec, transcript
from dppo.episodes.errors import describe_error
from dppo.episodes.records import TokenRecord, turn_seed
from dppo.episodes.results import episode_metrics
from dppo.rollout.base import Episode, Rollout, SamplingParams
from dppo.runtime.bounded import bounded_calls

COUNTERS = ("turns", "turns_truncated", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated")
"""The `Episode` counters an environment's episodes fill, reported as means per episode (`episode/<name>_mean`)."""


@dataclass(frozen=True)
class EnvEpisodes:
    """The run's environment episodes (`dppo.rollout.source.Episodes`): the `env` settings are all they hold."""

    settings: Any
    """The run config's `env` section, `dppo.episodes.settings.EnvSettings` (which builds these episodes)."""

    @property
    def max_turns(self) -> int:
        return self.settings.max_turns

    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    def collector(self) -> "EnvCollector":
        return EnvCollector(self.settings)

    def score(self, examples: Sequence, rollouts: list[Rollout]) -> None:
        """Nothing to do: the environment scored each episode while it ran (the sum of its turns' rewards)."""

    def check(self, example) -> str | None:
        s = self.settings
        env = make_environment(s.name, **s.options_dict)()
        try:
            check_messages(env.reset(example), s.name)
        finally:
            close = getattr(env, "close", None)  # (any class with reset and step is an environment)
            if callable(close):
                close()
        line = getattr(env, "start_line", None)
        return line() if callable(line) else None

    def metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        return episode_metrics(rollouts, COUNTERS)


class _EnvEpisode:
    """One episode's state: its environment, its token row and transcript, its reward and counters."""

    def __init__(self, prompt_index: int, env, prompt_ids: list[int], messages: list[dict]) -> None:
        self.prompt_index, self.env, self.messages = prompt_index, env, messages
        self.tokens = TokenRecord(prompt_ids)
        self.reward, self.turns, self.done, self.finish = 0.0, 0, False, "eos"
        self.stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "tool_truncated": 0.0,
                      "env_errors": 0.0, "env_timeouts": 0.0, "truncated": 0.0, "turns_truncated": 0.0}
        self.error: str | None = None
        self.closed = False
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
                          env_tokens=float(self.tokens.inserted), success=self.success, **self.stats)
        return self.tokens.to_rollout(self.prompt_index, self.finish, reward=self.reward, episode=episode)


class EnvCollector:
    """Runs `params.n` episodes per example on an engine, all episodes' turns batched into one engine call per turn.

    Picklable (it holds the settings; the environment factory and the codec are built in the process that runs it).
    """

    def __init__(self, settings) -> None:
        self.settings = settings
        self._factory = None
        self._codec: ChatCodec | None = None

    def __getstate__(self):
        return {"settings": self.settings}

    def __setstate__(self, state) -> None:
        self.__init__(state["settings"])

    def __call__(self, engine, examples: Sequence, params: SamplingParams) -> list[Rollout]:
        s = self.settings
        if self._factory is None:
            self._factory, self._codec = make_environment(s.name, **s.options_dict), ChatCodec(engine.tokenizer)
        episodes: list[_EnvEpisode] = []
        try:
            for p, example in enumerate(examples):
                episodes.extend(self._start(p, example) for _ in range(params.n))
            # (the hf engine: later turns prefill only their new tokens; a no-op for engines without the cache)
            engine.enable_prefix_cache(sum(len(ep.tokens.prompt_ids) + s.max_tokens for ep in episodes))
            try:
                for turn in range(s.max_turns):
                    active = [ep for ep in episodes if not ep.done]
                    if not active:
                        break
                    self._turn(engine, active, params, turn)
                    self._close([ep for ep in active if ep.done])
            finally:
                engine.enable_prefix_cache(0)
        finally:
            self._close(episodes)
        for ep in episodes:
            if not ep.done:  # max_turns reached without the environment ending it
                ep.end("length")
        return [ep.rollout() for ep in episodes]

    def _start(self, p: int, example) -> _EnvEpisode:
        """A fresh environment reset on `example` (bounded in time), its first prompt rendered with its tools."""
        s, env = self.settings, self._factory()
        [reset] = bounded_calls([lambda: env.reset(example)], s.timeout_s, name="dppo-env")
        try:
            if reset.status != "ok":
                raise ValueError(f"environment {s.name!r}: reset() failed on example {example.uid}: "
                                 f"{'timed out' if reset.status == 'timeout' else repr(reset.error)}")
            messages = check_messages(reset.value, s.name)
            schemas = [tool_schema(fn) for fn in getattr(env, "tools", ())]  # (any class with reset and step)
            return _EnvEpisode(p, env, self._codec.render(messages, schemas), messages)
        except BaseException:
            self._close_envs([env])
            raise

    def _close(self, episodes: list[_EnvEpisode]) -> None:
        """Each episode's environment closed once."""
        todo = [ep for ep in episodes if not ep.closed]
        for ep in todo:
            ep.closed = True
        self._close_envs([ep.env for ep in todo])

    def _close_envs(self, envs: list) -> None:
        """`envs` closed in parallel, bounded by timeout_s; a close that raises or hangs is ignored."""
        closes = [close for close in (getattr(env, "close", None) for env in envs) if callable(close)]
        if closes:  # (any class with reset and step is an environment: close is optional)
            bounded_calls(closes, self.settings.timeout_s, name="dppo-env-close")

    def _turn(self, engine, active: list[_EnvEpisode], params: SamplingParams, turn: int) -> None:
        budget = self.settings.max_tokens
        left = [budget - len(ep.tokens.ids) for ep in active]
        for ep, room in zip(active, left):
            if room < 1:
                ep.end("length")
        active = [ep for ep, room in zip(active, left) if room >= 1]
        if not active:
            return
        max_new = min(params.max_new_tokens, max(budget - len(ep.tokens.ids) for ep in active))
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=max_new, seed=turn_seed(params.seed, turn))
        if turn > 0 and engine.between_chunks is not None:  # in-flight updates: newer weights between turns too
            engine.between_chunks()
        rollouts = engine.generate([ep.tokens.context() for ep in active], turn_params)
        tokenizer = self._codec.tokenizer
        for ep, r in zip(active, rollouts):
            room = budget - len(ep.tokens.ids)
            if r.response_ids.numel() > room:  # (episodes with less room than the batch's longest turn)
                r = _cut(r, room)
            # the template ends an assistant turn with the tokenizer's EOS: a turn cut by max_new_tokens, or ended by
            # another stop id, gets it inserted (mask 0) before the boundary (`ChatCodec.append`)
            ep.tokens.add_generated(r, ep.turns, tokenizer.eos_token_id)
            ep.turns += 1
            reply = tokenizer.decode(r.response_ids.tolist(), skip_special_tokens=True)
            ep.messages.append({"role": "assistant", "content": reply})
            ep.stats["turns_truncated"] += float(r.finish_reason == "length")
        self._answer([ep for ep in active if not ep.done])

    def _answer(self, episodes: list[_EnvEpisode]) -> None:
        """Every episode's environment answers its last reply (in parallel threads; each call bounded in time)."""
        s = self.settings
        results = bounded_calls([lambda ep=ep: check_step(ep.env.step(ep.messages[-1]["content"]), s.name)
                                 for ep in episodes], s.timeout_s, name="dppo-env")
        for ep, outcome in zip(episodes, results):
            status, value = outcome.status, outcome.value if outcome.status == "ok" else outcome.error
            if status == "timeout":
                ep.stats["env_timeouts"] += 1
                ep.end("eos", f"environment {s.name!r}: step() timed out after {s.timeout_s:g}s")
                continue
            if status == "error":
                ep.stats["env_errors"] += 1
                ep.end("eos", f"environment {s.name!r}: {describe_error(value)}")
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
            ids = self._codec.append(step.messages, stopped=ep.tokens.stopped)
            if ep.turns >= s.max_turns or len(ep.tokens.ids) + len(ids) >= s.max_tokens:
                ep.end("length")  # no room for the environment's answer and another turn
                continue
            ep.messages.extend(dict(m) for m in step.messages)
            ep.tokens.add_inserted(ids, ep.turns - 1)  # (the turn it answers)


def _cut(r: Rollout, n: int) -> Rollout:
    """The first n tokens of a rollout (a turn longer than its episode's remaining budget), finish "length"."""
    cut = lambda t: None if t is None else t[:n]  # noqa: E731
    return dataclasses.replace(r, response_ids=r.response_ids[:n], rollout_logp=r.rollout_logp[:n],
                               token_versions=cut(r.token_versions), rollout_topk_ids=cut(r.rollout_topk_ids),
                               rollout_topk_logp=cut(r.rollout_topk_logp), rollout_topk_valid=cut(r.rollout_topk_valid),
                               finish_reason="length")


__all__ = ["COUNTERS", "EnvCollector", "EnvEpisodes"]
