"""OpenAI request bodies as the agent proxy takes them: what is refused and why, in the OpenAI error shape.

`check_request(body, endpoint, temperature=...)` → `Request` or `RequestError` (status 400, `invalid_request_error`,
the field in `param`). Refused: whatever the trust region cannot honour — a temperature other than the run's (µ is
recorded at the run's temperature), `top_p` < 1, `n` > 1 (the group is dppo's: G episodes, not G choices), beam
search, `best_of`, `logit_bias`, frequency / presence / repetition penalties, `min_p`, `top_k`, stop strings,
streaming, structured outputs, `tool_choice` other than `auto`; and fields the proxy does not know. The reason is in
the message, so an agent author sees why. Messages come back normalised (`developer` as `system`, text parts
joined, assistant `tool_calls` as {id, name, arguments}).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "min_p": (0, 0.0), "top_k": (0, -1), "logit_bias": ({},), "use_beam_search": (False,), "best_of": (1,),
           "logprobs": (False,), "top_logprobs": (0,), "stream": (False,), "stop": ([], "")}
"""Fields accepted only at the value that leaves the sampled distribution µ as recorded (None is always neutral)."""
WHY = {"frequency_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "presence_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "repetition_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "min_p": "truncated sampling changes µ (the trust region needs the full distribution)",
       "top_k": "truncated sampling changes µ (the trust region needs the full distribution)",
       "logit_bias": "a logit bias changes µ, so the recorded log-probs would not be the policy's",
       "use_beam_search": "beam search does not sample from the policy; DPPO needs sampled tokens",
       "best_of": "best-of selection does not sample from the policy; DPPO needs sampled tokens",
       "logprobs": "log-probs are recorded by dppo for training and not returned",
       "top_logprobs": "log-probs are recorded by dppo for training and not returned",
       "stream": "streaming responses are not supported by dppo's proxy; call without stream",
       "stop": "stop strings are not supported (the engines stop on token ids); end turns with the chat template"}
IGNORED = {"model", "user", "metadata", "store", "parallel_tool_calls", "seed", "service_tier", "prompt_cache_key",
           "safety_identifier", "reasoning_effort", "extra_body"}
"""Accepted and without effect (the run seeds every call; any model name is the run's policy)."""


class RequestError(ValueError):
    """A refused request, in the OpenAI error shape (status 400, `invalid_request_error`, the field in `param`)."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """A checked request: chat messages (chat endpoint) or a prompt (completions: text or token ids)."""

    messages: list[dict] | None
    tools: list[dict]
    prompt: str | list[int] | None
    max_tokens: int | None


def check_request(body: Any, endpoint: str, *, temperature: float) -> Request:
    """`body` of a `/v1/chat/completions` (`endpoint` "chat") or `/v1/completions` ("completions") request, checked
    (module docstring); RequestError otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = IGNORED | set(NEUTRAL) | {"temperature", "top_p", "n", "max_tokens", "max_completion_tokens"} | (
        {"messages", "tools", "tool_choice", "response_format"} if endpoint == "chat" else {"prompt", "echo", "suffix"})
    for key, value in body.items():
        if key not in known:
            raise RequestError(f"{key}: not supported by dppo's proxy", key, code="unsupported_parameter")
        if key in NEUTRAL and value is not None and value not in NEUTRAL[key]:
            raise RequestError(f"{key}: {value!r} refused: {WHY[key]}", key, code="unsupported_parameter")
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or not math.isclose(float(t), temperature, abs_tol=1e-6)):
        raise RequestError(f"temperature: {t!r} refused: this run samples (and records µ) at temperature "
                           f"{temperature:g}; omit it or send {temperature:g}", "temperature", code="unsupported_parameter")
    if body.get("top_p") not in (None, 1, 1.0):
        raise RequestError(f"top_p: {body['top_p']!r} refused: nucleus sampling changes µ; omit it or send 1", "top_p",
                           code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise RequestError(f"n: {body['n']!r} refused: one choice per call; dppo samples the group itself "
                           "(rollout.group_size episodes per question)", "n", code="unsupported_parameter")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise RequestError(f"{key}: not supported by dppo's proxy", key, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("response_format: structured outputs constrain sampling and change µ; only "
                           "{'type': 'text'} is accepted", "response_format", code="unsupported_parameter")
    if body.get("tool_choice") not in (None, "auto"):
        raise RequestError(f"tool_choice: {body['tool_choice']!r} refused: forcing or forbidding calls would need "
                           "constrained decoding, which changes µ; only 'auto'", "tool_choice", code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}", "max_tokens")
    if endpoint == "chat":
        return Request(_messages(body.get("messages")), _tools(body.get("tools")), None, max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # (the OpenAI client sends a batch of one)
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise RequestError("prompt: expected one non-empty string or one list of token ids", "prompt")
    return Request(None, [], prompt, max_tokens)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content: expected a string or a list of text parts", f"{where}.content")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"{where}.role: expected system, developer, user, assistant or tool", f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def _call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as e:
        raise RequestError(f"{where}.function.arguments: not JSON ({e})", where) from e
    return {"id": call.get("id"), "name": fn["name"], "arguments": parsed}


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools: expected a list of function tools", "tools")
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise RequestError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                               f"tools[{i}]")
    return [{"type": "function", "function": dict(t["function"])} for t in tools]


__all__ = ["IGNORED", "NEUTRAL", "Request", "RequestError", "check_request"]
