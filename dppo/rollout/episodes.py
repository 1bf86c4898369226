"""Multi-turn episodes, token in, token out: an environment's turns around an engine, as one trainable `Rollout`.

    collect = EpisodeCollector(EpisodeSpec("calculator", max_turns=4, max_tokens=384))
    rollouts = collect(engine, examples, params)       # params.n episodes per example, prompt-major

Layout of one episode (one `Rollout`; P = the first prompt's ids, rendered once by the chat template):

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
- Versions: each token records the weight version that sampled it; an episode's `weight_version` is its
  **oldest** generated token's, so its staleness is that of its stalest token. With in-flight updates (an async
  worker's `engine.between_chunks`), newer weights are also taken between turns, so an episode may span versions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dppo.rollout.base import Rollout, SamplingParams

_TURN_SEED_MULT = 0x5851F42D4C957F2D


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn`: (seed + turn·m) mod 2^62 with m odd, so no turn's seed is another async
    share's (which adds 2^40) or another rank's (2^32)."""
    return None if seed is None else (seed + turn * _TURN_SEED_MULT) % (1 << 62)


_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


@dataclass(frozen=True)
class EpisodeSpec:
    """Everything a process needs to run episodes (picklable: rollout workers receive it)."""

    env: str
    """An environment name (`dppo.envs.ENVIRONMENTS`) or import path."""
    options: dict = field(default_factory=dict)
    """The environment's keyword options."""
    max_turns: int = 4
    """Assistant turns per episode."""
    max_tokens: int = 384
    """Response tokens of a whole episode (generated and environment tokens after the first prompt)."""
    env_timeout_s: float = 30.0
    """Longest an environment's reset or step may take; past it the episode ends, counted as an env timeout."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns: expected >= 1, got {self.max_turns}")
        if self.max_tokens < 1:
            raise ValueError(f"env.max_tokens: expected >= 1, got {self.max_tokens}")
        if not self.env_timeout_s > 0:
            raise ValueError(f"env.timeout_s: expected > 0, got {self.env_timeout_s}")

    def factory(self):
        from dppo.envs import make_environment

        return make_environment(self.env, **self.options)


class ChatDelta:
    """Token ids of appended messages, without re-rendering the transcript (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        from dppo.envs.tools import template_supports_tools

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
        from dppo.envs.tools import render_messages_with_tools

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


def _bounded(fns: Sequence, timeout_s: float) -> list[tuple[str, Any]]:
    """Each fn() in its own daemon thread, all at once, each given `timeout_s`: per fn ("ok", value) |
    ("error", exception) | ("timeout", None) (a thread still running is abandoned)."""
    boxes: list[dict[str, Any]] = [{} for _ in fns]

    def run(fn, box) -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - contained and reported by the caller
            box["error"] = exc

    threads = [threading.Thread(target=run, args=(fn, box), daemon=True) for fn, box in zip(fns, boxes)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    out = []
    for t, box in zip(threads, boxes):
        t.join(max(0.0, deadline - time.monotonic()))
        out.append(("timeout", None) if t.is_alive() else
                   ("error", box["error"]) if "error" in box else ("ok", box.get("value")))
    return out


class _Episode:
    """One episode's growing token record and transcript."""

    def __init__(self, prompt_index: int, env, prompt_ids: list[int], messages: list[dict]) -> None:
        self.prompt_index, self.env = prompt_index, env
        self.prompt_ids, self.messages = prompt_ids, messages
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.mask: list[bool] = []
        self.turn: list[int] = []
        self.versions: list[int] = []
        self.cells: list[tuple] = []  # per turn: (ids [t, S], logp, valid) or env placeholder length
        self.reward, self.turns, self.done, self.finish = 0.0, 0, False, "eos"
        self.stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "tool_truncated": 0.0,
                      "env_errors": 0.0, "env_timeouts": 0.0, "truncated": 0.0, "turns_truncated": 0.0}
        self.stopped = True  # whether the last turn ended with the engine's stop token
        self.error: str | None = None

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_generated(self, r: Rollout) -> None:
        n = int(r.response_ids.numel())
        self.ids += r.response_ids.tolist()
        self.logp += r.rollout_logp.tolist()
        self.mask += [True] * n
        self.turn += [self.turns] * n
        versions = r.token_versions if r.token_versions is not None else torch.full((n,), r.weight_version)
        self.versions += versions.tolist()
        self.cells.append((r.rollout_topk_ids, r.rollout_topk_logp, r.rollout_topk_valid) if r.rollout_topk_ids is not None else n)

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.logp += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.turn += [self.turns - 1] * len(ids)  # (the turn it answers)
        self.versions += [self.versions[-1]] * len(ids)
        self.cells.append(len(ids))

    def end(self, finish: str, error: str | None = None) -> None:
        self.done, self.finish = True, finish
        if finish == "length":
            self.stats["truncated"] = 1.0
        if error is not None:
            self.error = error

    def rollout(self) -> Rollout:
        mask = torch.tensor(self.mask, dtype=torch.bool)
        versions = torch.tensor(self.versions, dtype=torch.long)
        out = Rollout(prompt_index=self.prompt_index, prompt_ids=torch.tensor(self.prompt_ids, dtype=torch.long),
                      response_ids=torch.tensor(self.ids, dtype=torch.long),
                      rollout_logp=torch.tensor(self.logp, dtype=torch.float32), finish_reason=self.finish,
                      weight_version=int(versions[mask].min()), token_versions=versions, loss_mask=mask,
                      turn_index=torch.tensor(self.turn, dtype=torch.long), reward=self.reward,
                      episode={**self.stats, "turns": float(self.turns), "env_tokens": float((~mask).sum()),
                               "error": self.error, "messages": self.messages})
        widths = [c[0].shape[-1] for c in self.cells if isinstance(c, tuple)]
        if widths:  # µ's top-K cells of generated tokens; invalid (id 0, log-prob 0) on environment tokens
            S = widths[0]
            parts = [c if isinstance(c, tuple) else (torch.zeros((c, S), dtype=torch.long),
                                                     torch.zeros((c, S)), torch.zeros((c, S), dtype=torch.bool))
                     for c in self.cells]
            out.rollout_topk_ids, out.rollout_topk_logp, out.rollout_topk_valid = (torch.cat(p) for p in zip(*parts))
        return out


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
        from dppo.envs.base import check_messages
        from dppo.envs.tools import tool_schema

        episodes = []
        for p, example in enumerate(examples):
            for _ in range(params.n):
                env = self._factory()
                [(status, value)] = _bounded([lambda: env.reset(example)], spec.env_timeout_s)
                if status != "ok":
                    raise ValueError(f"environment {spec.env!r}: reset() failed on example {example.uid}: "
                                     f"{'timed out' if status == 'timeout' else repr(value)}")
                messages = check_messages(value, spec.env)
                schemas = [tool_schema(fn) for fn in getattr(env, "tools", ())]
                episodes.append(_Episode(p, env, self._delta.prompt(messages, schemas), messages))
        cache = getattr(engine, "enable_prefix_cache", None)  # the hf engine: later turns prefill only new tokens
        if cache is not None:
            cache(sum(len(ep.prompt_ids) + spec.max_tokens for ep in episodes))
        try:
            for turn in range(spec.max_turns):
                active = [ep for ep in episodes if not ep.done]
                if not active:
                    break
                self._turn(engine, active, params, turn)
        finally:
            if cache is not None:
                cache(0)
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
        poll = getattr(engine, "between_chunks", None)
        if turn > 0 and poll is not None:  # in-flight updates: newer weights may arrive between turns too
            poll()
        rollouts = engine.generate([ep.context() for ep in active], turn_params)
        for ep, r in zip(active, rollouts):
            room = spec.max_tokens - len(ep.ids)
            if r.response_ids.numel() > room:  # (episodes with less room than the batch's longest turn)
                r = _cut(r, room)
            ep.add_generated(r)
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
        from dppo.envs.base import check_step

        spec = self.spec
        results = _bounded([lambda ep=ep: check_step(ep.env.step(ep.messages[-1]["content"]), spec.env)
                            for ep in episodes], spec.env_timeout_s)
        for ep, (status, value) in zip(episodes, results):
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
            if step.done:
                ep.end("eos")
                continue
            ids = ([] if ep.stopped else [self._delta.tokenizer.eos_token_id]) + self._delta.boundary \
                + self._delta.suffix(step.messages)
            if ep.turns >= spec.max_turns or len(ep.ids) + len(ids) >= spec.max_tokens:
                ep.end("length")  # no room for the environment's answer and another turn
                continue
            ep.messages.extend(dict(m) for m in step.messages)
            ep.add_env(ids)


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


__all__ = ["ChatDelta", "EpisodeCollector", "EpisodeSpec", "transcript", "turn_seed"]
