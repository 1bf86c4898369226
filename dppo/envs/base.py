"""The environment protocol of multi-turn episodes: what an episode's environment answers after each assistant turn.

An episode starts from a task example:

    env = make_environment("calculator")()     # a fresh Environment per episode (the registry holds factories)
    messages = env.reset(example)             # the first messages (system / user); `env.tools` are the tools it exposes
    step = env.step(reply)                     # after each assistant turn: EnvStep(messages, reward, done, info)
    env.close()                                # when the episode ends, however it ends (optional: sockets, clients)

`step.messages` (tool answers, or a user's feedback) are appended to the transcript after the assistant's reply;
`step.reward` is this turn's reward (an episode's reward is the sum over its turns); `done` ends the episode.
The episode runner (`dppo.episodes.env_loop`) owns the token ids: an environment sees and returns text messages
only, never token ids, so it cannot change the tokens the policy sampled.

`ToolEnv` is the base of tool-using environments: a reply holding Hermes tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) gets one `tool` message per call (an unknown tool, bad
arguments, a tool that raises or hangs: an error message as the answer, counted in `info`, never a crash); a reply
without a tool call is the final answer, scored by `score` and ending the episode.

`demonstration(example)` (optional): a synthetic transcript of a good episode (the messages after `reset`'s), which
`dppo sft` trains on so that a small model learns the tool format before RL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dppo.example import Example, Message
from dppo.envs.tools import ToolResult, call_tool, format_tool_message, malformed_result, parse_tool_calls


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one assistant turn."""

    messages: tuple[Message, ...] = ()
    """Messages appended after the assistant's reply ({"role": "tool" | "user", "content": str}); empty when done."""
    reward: float = 0.0
    """This turn's reward (the episode's reward is the sum over its turns)."""
    done: bool = False
    """True ends the episode."""
    info: dict[str, float] = field(default_factory=dict)
    """Counters of this turn, summed over the episode: tool_calls, tool_errors, tool_timeouts, tool_truncated."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))


class Environment:
    """One episode's environment (see the module docstring). Subclass it; a fresh instance serves each episode."""

    tools: Sequence[Callable] = ()
    """The tools this environment exposes (plain functions with type hints and a docstring)."""

    def reset(self, example: Example) -> list[Message]:
        """The episode's first messages. Default: the example's chat prompt (a raw-text prompt becomes a user message)."""
        self.example = example
        prompt = example.prompt
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def step(self, reply: str) -> EnvStep:
        """The answer to the assistant's `reply` (its text, special tokens removed)."""
        raise NotImplementedError

    def demonstration(self, example: Example) -> list[Message] | None:
        """A good episode's messages after `reset(example)`'s (assistant turns and the environment's answers), or None."""
        return None

    def close(self) -> None:
        """Release what the episode holds (a client, a socket). The episode runner calls it once when the episode
        ends, however it ends (done, truncated, an error, a failed reset); it may run while a hung `step` is still
        running in its abandoned thread. Default: nothing to release."""

    @staticmethod
    def start_line() -> str | None:
        """A line the trainer prints at start (e.g. the sandbox layer in use), or None."""
        return None


class ToolEnv(Environment):
    """An environment whose assistant may call `tools` (Hermes tool calls) before a final answer scored by `score`.

    max_tool_chars: a tool answer longer than this is truncated (marked). tool_timeout_s: a tool call running longer
    is abandoned and answered with a timeout error. max_calls_per_turn: calls after this many in one reply are
    answered with an error.
    """

    def __init__(self, *, max_tool_chars: int = 1000, tool_timeout_s: float = 10.0, max_calls_per_turn: int = 4) -> None:
        if max_tool_chars < 1:
            raise ValueError(f"max_tool_chars: expected >= 1, got {max_tool_chars}")
        if not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s: expected > 0, got {tool_timeout_s}")
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn: expected >= 1, got {max_calls_per_turn}")
        self.max_tool_chars, self.tool_timeout_s, self.max_calls_per_turn = max_tool_chars, tool_timeout_s, max_calls_per_turn

    def score(self, answer: str) -> float:
        """The reward of the final answer (a reply without tool calls)."""
        raise NotImplementedError

    def step(self, reply: str) -> EnvStep:
        calls, malformed = parse_tool_calls(reply)
        if not calls and not malformed:
            return EnvStep(reward=float(self.score(reply)), done=True)
        tools = {fn.__name__: fn for fn in self.tools}
        results = [malformed_result(why, max_chars=self.max_tool_chars) for why in malformed]
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                results.append(ToolResult(content=f"Error: at most {self.max_calls_per_turn} tool calls per turn",
                                          error="too_many_calls", truncated=False, timed_out=False))
                continue
            results.append(call_tool(tools, call, max_chars=self.max_tool_chars, timeout_s=self.tool_timeout_s))
        info = {"tool_calls": float(len(calls) + len(malformed)),
                "tool_errors": float(sum(r.error is not None for r in results)),
                "tool_timeouts": float(sum(r.timed_out for r in results)),
                "tool_truncated": float(sum(r.truncated for r in results))}
        return EnvStep(messages=tuple(format_tool_message(r) for r in results), info=info)


def check_step(step: Any, name: str) -> EnvStep:
    """`step` if it is a well-formed EnvStep; otherwise TypeError naming the environment and what is wrong."""
    if not isinstance(step, EnvStep):
        raise TypeError(f"environment {name!r}: step() returned {type(step).__name__}, expected an EnvStep")
    _check_each(step.messages, name, "step")
    if not isinstance(step.reward, (int, float)) or step.reward != step.reward or abs(step.reward) == float("inf"):
        raise TypeError(f"environment {name!r}: step() returned a non-finite or non-numeric reward {step.reward!r}")
    if not step.done and not step.messages:
        raise TypeError(f"environment {name!r}: step() returned no messages and done=False (nothing to answer)")
    return step


def check_messages(messages: Any, name: str) -> list[Message]:
    """`reset`'s messages if well-formed; otherwise TypeError naming the environment."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"environment {name!r}: reset() returned {type(messages).__name__}, expected a non-empty "
                        f"list of messages")
    _check_each(messages, name, "reset")
    return [dict(m) for m in messages]


def _check_each(messages, name: str, method: str) -> None:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TypeError(f"environment {name!r}: {method}() returned a message that is not "
                            f"{{'role': str, 'content': str}}: {m!r:.200}")
