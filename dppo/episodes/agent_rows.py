"""An agent's episode as training rows: the proxy's calls joined token in, token out.

Every call of an episode (`ProxyEpisode`) is answered from a prompt made of token ids, and becomes part of a row
(a `Row`: a `dppo.episodes.records.TokenRecord` and what a later call must extend to join it):

- **Joins a row** when it extends one: a chat call whose messages are a row's transcript so far (its messages and
  the assistant message the proxy returned, compared field by field) followed by new messages, *and* whose chat
  template renders that transcript as a prefix of the whole request (`dppo.episodes.chat.ChatCodec.extend`: the
  template did not rewrite it); or a completions call whose prompt ids start with the row's ids. The row's ids are
  kept as sampled, the new messages' ids are the template's rendering of them (the suffix after the transcript;
  the template's boundary after the stop token, and the stop token itself when the engine did not sample it,
  included) and enter the row with loss mask 0; the call's generated tokens follow with mask 1, µ and µ's top-K.
- **Starts a row** otherwise (a template that strips earlier reasoning, an agent that edits its history, a
  sub-agent's own conversation): the whole request rendered by the template is the new row's prompt.

Rows are tried newest first. All rows of an episode share its reward (and so its advantage); each generated
token's turn is the call that sampled it (per-call metrics), its version the weights that sampled it.
"""

from __future__ import annotations

import json
import math

from dppo.episodes.chat import ChatCodec, template_messages, transcript
from dppo.episodes.records import TokenRecord
from dppo.rollout.base import Episode, Rollout


class Row:
    """One training row of an agent episode: its tokens, and what a later call must extend to join it."""

    def __init__(self, prompt_ids: list[int], messages: list[dict] | None, tools: list[dict],
                 template_kwargs: dict | None = None) -> None:
        self.tokens = TokenRecord(prompt_ids)
        self.template_kwargs = template_kwargs  # the chat template's extra arguments (a joining call must send the same)
        self.messages = messages  # the transcript as the client sends it (None: a completions row)
        self.raw = template_messages(messages) if messages is not None else None  # as the template renders it
        self.tools = tools
        self.returned: dict | None = None  # the assistant message of the last call, as returned to the client
        self.busy = False  # a call on it is in flight (a concurrent call of the episode starts its own row)

    def remember(self, messages: list[dict], text: str, message: dict, *, new: bool) -> None:
        """After a chat call on this row: its transcript is `messages` and the reply (generated `text`, returned to
        the client as `message`)."""
        if not new:
            k = len(self.messages)
            self.raw = self.raw + [{"role": "assistant", "content": self.returned["raw"]}] + \
                template_messages(messages[k + 1:])
        self.messages = messages
        self.returned = {"role": "assistant", "content": message["content"] or "", "raw": text,
                         "tool_calls": [{"id": c["id"], "name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"])}
                                        for c in message.get("tool_calls") or []]}


def _same_message(sent: dict, kept: dict) -> bool:
    """Whether a client's message is the one the proxy returned (content and tool calls; call ids when sent)."""
    if sent["role"] != kept["role"] or (sent.get("content") or "") != (kept.get("content") or ""):
        return False
    a, b = sent.get("tool_calls", []), kept.get("tool_calls", [])
    return len(a) == len(b) and all(x["name"] == y["name"] and x["arguments"] == y["arguments"]
                                    and (x.get("id") is None or x["id"] == y.get("id")) for x, y in zip(a, b))


def chat_join(row: Row, messages: list[dict], tools: list[dict], codec: ChatCodec,
              template_kwargs: dict | None = None) -> list[int] | None:
    """The ids the chat call `messages` appends to `row` (before its generation), or None when it does not extend
    the row (module docstring)."""
    if row.messages is None or row.returned is None or tools != row.tools or template_kwargs != row.template_kwargs:
        return None
    k = len(row.messages)
    if len(messages) <= k + 1 or not all(_same_message(m, r) for m, r in zip(messages[:k], row.messages)):
        return None
    if not _same_message(messages[k], row.returned) or any(m["role"] == "assistant" for m in messages[k + 1:]):
        return None
    history = row.raw + [{"role": "assistant", "content": row.returned["raw"]}]
    return codec.extend(history, template_messages(messages[k + 1:]), tools, stopped=row.tokens.stopped,
                        template_kwargs=template_kwargs)


def ids_join(row: Row, prompt: list[int]) -> list[int] | None:
    """The ids a completions call with `prompt` appends to `row`, or None when it does not start with the row's."""
    context = row.tokens.context()
    if row.messages is not None or len(prompt) <= len(context) or prompt[:len(context)] != context:
        return None
    return prompt[len(context):]


class ProxyEpisode:
    """One agent episode at the proxy: its rows, calls, reward and what went wrong."""

    def __init__(self, prompt_index: int, example, key: str, order: int = 0) -> None:
        self.prompt_index, self.example, self.key, self.order = prompt_index, example, key, order
        self.rows: list[Row] = []
        self.calls, self.tool_calls, self.refused, self.truncated = 0, 0, 0, 0
        self.reward: float | None = None
        self.posted: float | None = None
        self.error: str | None = None
        self.timed_out = False
        self.closed = False

    def place(self, messages: list[dict] | None, tools: list[dict], prompt: list[int] | None, codec: ChatCodec,
              template_kwargs: dict | None = None):
        """(row, ids to append, is_new) for a call: the newest row it extends, else a new row. `template_kwargs`:
        the chat template's extra arguments (`chat_template_kwargs`)."""
        for row in reversed(self.rows):
            if row.busy:
                continue
            extra = chat_join(row, messages, tools, codec, template_kwargs) if messages is not None \
                else ids_join(row, prompt)
            if extra is not None:
                return row, extra, False
        if messages is None:
            return Row(list(prompt), None, tools), [], True
        ids = codec.render(template_messages(messages), tools, template_kwargs=template_kwargs)
        return Row(ids, messages, tools, template_kwargs), [], True

    def record(self, row: Row, extra: list[int], new: bool, result: Rollout, eos_id: int) -> None:
        """A call's tokens into `row`: the ids it appended (`extra`, mask 0, as the turn they answer), then what it
        generated (`result`, this call's turn)."""
        if extra:
            row.tokens.add_inserted(extra, max(self.calls - 1, 0))
        row.tokens.add_generated(result, self.calls, eos_id)
        self.calls += 1
        if new:
            self.rows.append(row)

    def rollouts(self, eos_id: int, version: int) -> list[Rollout]:
        """The episode's rows as rollouts (the first carries the episode's record; every row its reward). An
        episode that made no call gets one row with no trained token (its reward still counts in its group)."""
        reward = self.reward if self.reward is not None else 0.0
        failed = self.error is not None
        rows = [r for r in self.rows if r.tokens.mask.count(True)]
        records = [r.tokens for r in rows] or [TokenRecord.empty(eos_id, version)]
        out = []
        for i, tokens in enumerate(records):
            row = rows[i] if rows else None
            text = transcript(row.messages + [{"role": "assistant", "content": row.returned["raw"]}]) \
                if row is not None and row.messages is not None and row.returned is not None else ""
            if i == 0:
                text += f"\n<error> {self.error}" if self.error else ""
                record = Episode(completion=text, error=self.error, turns=float(self.calls),
                                 tool_calls=float(self.tool_calls), truncated=float(self.truncated > 0),
                                 env_errors=float(failed and not self.timed_out), env_timeouts=float(self.timed_out),
                                 env_tokens=float(sum(t.inserted for t in records)), success=math.nan,
                                 refused_calls=float(self.refused))
            else:
                record = Episode(completion=text, turns=0.0)
            finish = "length" if self.truncated else "eos"
            out.append(tokens.to_rollout(self.prompt_index, finish, reward=reward, episode=record, row=i))
        return out


__all__ = ["ProxyEpisode", "Row", "chat_join", "ids_join"]
