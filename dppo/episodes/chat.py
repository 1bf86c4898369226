"""Chat messages as token ids and back: the one codec of the environment loop and of the agent proxy's join rule.

    codec = ChatCodec(tokenizer)                        # append_only: the template checked at start
    prompt = codec.render(messages, tools)              # the first prompt's ids (tools through the template, or the
                                                        # Hermes tool prompt in the system message)
    ids = codec.extend(history, new, tools, stopped=s)  # the ids `new` appends after `history` (which ends with an
                                                        # assistant message), or None when the template rewrote it
    ids = codec.append(new, stopped=s)                  # the same against a fixed synthetic history (environments)

**The rule.** The ids that messages append to a transcript are the template's own rendering: render the history
(no generation prompt) and the history with the new messages (with the generation prompt); when the first is a
prefix of the second, the suffix is what the new messages add. The template's boundary after the assistant's stop
token (ChatML's `\\n` after `<|im_end|>`) comes first, and the stop token itself before it when the engine did not
sample it (a turn cut by max_new_tokens, or ended by another stop id). So the ids trained are exactly the ids
sampled, and what the template would render for the whole transcript is what the row holds.

- An environment's messages are appended to a fixed synthetic conversation (`SYNTHETIC`), not to the transcript:
  nothing is ever re-rendered, so a turn costs only its new text. That needs a template that only appends and ends
  an assistant message with the EOS token: `ChatCodec(tokenizer)` refuses another by name at start, before any
  model runs.
- The proxy renders the real history (`ChatCodec(tokenizer, append_only=False)`): a template that rewrites it
  (one that strips earlier reasoning) makes `extend` return None, and the call starts a new row.

Also here: an assistant message as the model writes it (Hermes `<tool_call>` blocks, `template_messages`), a
generated reply as an OpenAI message (`reply_message`), and an episode as text for the samples file
(`transcript`).
"""

from __future__ import annotations

import json
from functools import cached_property

from dppo.envs.tools import parse_tool_calls, render_messages_with_tools, template_supports_tools

SYNTHETIC = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"})
"""The fixed history environment messages are appended to (`ChatCodec.append`)."""


class ChatCodec:
    """A tokenizer's chat template as token ids (module docstring)."""

    def __init__(self, tokenizer, *, append_only: bool = True) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        if append_only:
            self._check_append_only()

    @cached_property
    def tools_in_template(self) -> bool:
        """Whether the template renders `tools=` (else the tools go in the system prompt)."""
        return template_supports_tools(self.tokenizer)

    @cached_property
    def base(self) -> list[int]:
        """The ids of `SYNTHETIC`, without the generation prompt."""
        return self.render(SYNTHETIC, generation_prompt=False)

    def _check_append_only(self) -> None:
        if self.eos not in self.base:
            raise ValueError("tokenizer: its chat template does not end an assistant message with the EOS token "
                             f"{self.tokenizer.eos_token!r}; token-in-token-out episodes need it")
        probe = self.render([*SYNTHETIC, {"role": "user", "content": "V"}, {"role": "assistant", "content": "B"}],
                            generation_prompt=False)
        if probe[:len(self.base)] != self.base:
            raise ValueError("tokenizer: its chat template rewrites earlier messages when one is appended, so an "
                             "episode cannot keep the sampled ids; token-in-token-out episodes need a template "
                             "that only appends")

    def render(self, messages, tools=(), *, generation_prompt: bool = True, template_kwargs: dict | None = None
               ) -> list[int]:
        """Token ids of `messages` with `tools` (through the template when it renders `tools=`, else the Hermes tool
        prompt in the system message), through the tokenizer's chat template (given `template_kwargs` too, e.g. a
        client's `enable_thinking`)."""
        kwargs = dict(template_kwargs or {})
        if tools and self.tools_in_template:
            kwargs["tools"] = list(tools)
        elif tools:
            messages = render_messages_with_tools(self.tokenizer, list(messages), list(tools))
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                 tokenize=True, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def extend(self, history, messages, tools=(), *, stopped: bool, template_kwargs: dict | None = None
               ) -> list[int] | None:
        """The ids `messages` append after `history` (ending with an assistant message whose generation ended with
        the stop token when `stopped`), up to the next generation prompt; None when the template rewrites
        `history` once they are appended."""
        base = self.render(history, tools, generation_prompt=False, template_kwargs=template_kwargs)
        return self._tail(base, self.render([*history, *messages], tools, template_kwargs=template_kwargs), stopped)

    def append(self, messages, *, stopped: bool = True) -> list[int]:
        """`extend` of the synthetic history: the ids an environment's `messages` add (ValueError when the template
        rewrites earlier messages)."""
        out = self._tail(self.base, self.render([*SYNTHETIC, *messages]), stopped)
        if out is None:
            raise ValueError("tokenizer: the chat template rewrote earlier messages when environment messages were "
                             "appended; token-in-token-out episodes need a template that only appends")
        return out

    def boundary(self, base: list[int]) -> list[int]:
        """The template's tokens after the last assistant stop token of `base` (ChatML: the newline)."""
        ends = [i for i, t in enumerate(base) if t == self.eos]
        return base[ends[-1] + 1:] if ends else []

    def _tail(self, base: list[int], full: list[int], stopped: bool) -> list[int] | None:
        if full[:len(base)] != base:
            return None
        return ([] if stopped else [self.eos]) + self.boundary(base) + full[len(base):]


def hermes_text(message: dict) -> str:
    """An assistant message as the model writes it: its content, then one Hermes block per tool call."""
    blocks = [f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['arguments']})}</tool_call>"
              for c in message.get("tool_calls", ())]
    return "\n".join(([message["content"]] if message["content"] else []) + blocks)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat template takes them (assistant tool calls written as Hermes text)."""
    return [{"role": m["role"], "content": hermes_text(m) if m["role"] == "assistant" else m["content"]}
            for m in messages]


def reply_message(text: str, call_base: int) -> tuple[dict, str]:
    """The OpenAI assistant message of a generated reply and its finish reason's kind ("tool_calls" when the reply
    holds well-formed Hermes calls, else "stop"). Malformed blocks stay in the content (the agent sees what the
    model wrote). `call_base` numbers the call ids (unique within the episode)."""
    calls, malformed = parse_tool_calls(text)
    if not calls or malformed:
        return {"role": "assistant", "content": text}, "stop"
    content = text[:text.find("<tool_call>")].strip()
    tool_calls = [{"id": f"call_{call_base + i}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


def transcript(messages: list[dict]) -> str:
    """A whole episode as text for the samples file; the environment's messages (every non-assistant message after
    the first assistant turn) are marked `[env]`."""
    lines, replied = [], False
    for m in messages:
        replied |= m["role"] == "assistant"
        mark = " [env]" if replied and m["role"] != "assistant" else ""
        lines.append(f"<{m['role']}{mark}> {m['content']}")
    return "\n".join(lines)


__all__ = ["ChatCodec", "SYNTHETIC", "hermes_text", "reply_message", "template_messages", "transcript"]
