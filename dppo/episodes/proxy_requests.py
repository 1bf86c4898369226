"""OpenAI request bodies as the agent proxy takes them: what is refused and why, in the OpenAI error shape.

`check_request(body, endpoint, temperature=..., top_k=..., stop_ids=...)` → `Request` or `RequestError` (status 400,
`invalid_request_error`, the field in `param`). Refused: whatever the trust region cannot honour — a temperature
other than the run's (µ is recorded at the run's temperature), `top_p` < 1, `n` > 1 (the group is dppo's: G
episodes, not G choices), beam search, `best_of`, `logit_bias`, frequency / presence / repetition penalties, `min_p`,
`top_k`, stop strings, stop token ids the engine does not stop on, structured outputs, `tool_choice` other than
`auto`; `top_logprobs` above the run's recorded K; and fields the proxy does not know. The reason is in the message,
so an agent author sees why. Accepted because they leave µ as recorded (docs/agents.md, "What clients send"):
`logprobs` / `top_logprobs` ≤ K (µ and its top-K cells are returned as recorded), `return_token_ids` /
`return_tokens_as_token_ids`, `stream` (an SSE stream of the whole answer) with `stream_options.include_usage`,
`chat_template_kwargs` (they change the rendered prompt, which is what is recorded), `skip_special_tokens` (the
returned text only), `cache_salt`, `priority`, `seed` (the run seeds every call), `include_stop_str_in_output`.
Messages come back normalised (`developer` as `system`, text parts joined, assistant `tool_calls` as {id, name,
arguments}).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "min_p": (0, 0.0), "top_k": (0, -1), "logit_bias": ({},), "use_beam_search": (False,), "best_of": (1,),
           "stop": ([], "")}
"""Fields accepted only at the value that leaves the sampled distribution µ as recorded (None is always neutral)."""
WHY = {"frequency_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "presence_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "repetition_penalty": "a penalty changes the sampled distribution, so µ would not be the distribution recorded",
       "min_p": "truncated sampling changes µ (the trust region needs the full distribution)",
       "top_k": "truncated sampling changes µ (the trust region needs the full distribution)",
       "logit_bias": "a logit bias changes µ, so the recorded log-probs would not be the policy's",
       "use_beam_search": "beam search does not sample from the policy; DPPO needs sampled tokens",
       "best_of": "best-of selection does not sample from the policy; DPPO needs sampled tokens",
       "stop": "stop strings are not supported (the engines stop on token ids); end turns with the chat template"}
IGNORED = {"model", "user", "metadata", "store", "parallel_tool_calls", "seed", "service_tier", "prompt_cache_key",
           "safety_identifier", "reasoning_effort", "extra_body", "cache_salt", "priority", "include_stop_str_in_output",
           "spaces_between_special_tokens", "request_id"}
"""Accepted and without effect on the sample (the run seeds every call; any model name is the run's policy; a cache
salt or a priority changes what the engine caches or serves first, not µ; with no stop strings there is none to
include)."""
ANSWERED = {"logprobs", "top_logprobs", "return_token_ids", "return_tokens_as_token_ids", "stream", "stream_options",
            "chat_template_kwargs", "skip_special_tokens", "stop_token_ids"}
"""Accepted and answered (module docstring)."""
RENDERING = {"conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
             "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "chat_template"}
"""`apply_chat_template` arguments a client's `chat_template_kwargs` may not set (the proxy renders the prompt)."""


class RequestError(ValueError):
    """A refused request, in the OpenAI error shape (status 400, `invalid_request_error`, the field in `param`)."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """A checked request: chat messages (chat endpoint) or a prompt (completions: text or token ids), and what the
    answer returns beside the text."""

    messages: list[dict] | None
    tools: list[dict]
    prompt: str | list[int] | None
    max_tokens: int | None
    logprobs: bool = False
    """Return µ of each generated token (`logprobs`)."""
    top_logprobs: int = 0
    """Return µ's top cells of each token, up to the run's recorded K (`top_logprobs`; completions: `logprobs: N`)."""
    token_ids: bool = False
    """Return the prompt's and the generated token ids (`return_token_ids`)."""
    tokens_as_ids: bool = False
    """Name tokens `token_id:<id>` in the returned log-probs (`return_tokens_as_token_ids`)."""
    stream: bool = False
    include_usage: bool = False
    """With `stream`: a last chunk with the usage (`stream_options.include_usage`)."""
    template_kwargs: dict | None = None
    """`chat_template_kwargs`, passed to the chat template (they change the rendered prompt, which is recorded)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text (the recorded tokens are the same either way)."""


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key}: expected true or false, got {value!r}", key)
    return bool(value)


def _count(body: dict, key: str, top_k: int) -> int:
    value = body.get(key)
    if value is None or value is False:
        return 0
    if value is True:
        return 0 if key == "top_logprobs" else 1
    if not isinstance(value, int) or value < 0:
        raise RequestError(f"{key}: expected an integer >= 0, got {value!r}", key)
    if value > top_k:
        raise RequestError(f"{key}: {value} refused: this run records µ's top {top_k} log-probs "
                           f"(rollout.top_k_logprobs); ask for at most {top_k}", key, code="unsupported_parameter")
    return value


def check_request(body: Any, endpoint: str, *, temperature: float, top_k: int = 0,
                  stop_ids: frozenset[int] | set[int] = frozenset()) -> Request:
    """`body` of a `/v1/chat/completions` (`endpoint` "chat") or `/v1/completions` ("completions") request, checked
    (module docstring); RequestError otherwise. `top_k`: the top log-probs the run records per token; `stop_ids`: the
    token ids the engine stops on."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = IGNORED | ANSWERED | set(NEUTRAL) | {"temperature", "top_p", "n", "max_tokens", "max_completion_tokens"} | (
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
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise RequestError("stop_token_ids: expected a list of token ids", "stop_token_ids")
    if set(stops) - set(stop_ids):
        raise RequestError(f"stop_token_ids: {sorted(set(stops) - set(stop_ids))} refused: the engine stops on "
                           f"{sorted(stop_ids)} only, and another stop would end samples the run would continue",
                           "stop_token_ids", code="unsupported_parameter")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options: expected an object", "stream_options")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs: expected an object", "chat_template_kwargs")
    reserved = sorted(set(kwargs or {}) & RENDERING)
    if reserved:
        raise RequestError(f"chat_template_kwargs: {', '.join(reserved)} refused: the proxy renders the prompt itself "
                           "(the conversation, the tools and the generation prompt come from the request)",
                           "chat_template_kwargs")
    if endpoint == "chat":  # chat: `logprobs` a flag, `top_logprobs` a count; completions: `logprobs` the count
        top = _count(body, "top_logprobs", top_k)
        want = _flag(body, "logprobs")
        if top and not want:
            raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
    else:
        top = _count(body, "logprobs", top_k)
        want = body.get("logprobs") not in (None, False)
    skip = body.get("skip_special_tokens")
    extras = dict(logprobs=want, top_logprobs=top, token_ids=_flag(body, "return_token_ids"),
                  tokens_as_ids=_flag(body, "return_tokens_as_token_ids"), stream=_flag(body, "stream"),
                  include_usage=bool((options or {}).get("include_usage")), template_kwargs=kwargs or None,
                  skip_special_tokens=True if skip is None else bool(skip))
    if endpoint == "chat":
        return Request(_messages(body.get("messages")), _tools(body.get("tools")), None, max_tokens, **extras)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # (the OpenAI client sends a batch of one)
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise RequestError("prompt: expected one non-empty string or one list of token ids", "prompt")
    if kwargs:
        raise RequestError("chat_template_kwargs: only for chat requests (a completions prompt is not rendered)",
                           "chat_template_kwargs")
    return Request(None, [], prompt, max_tokens, **extras)


TOKEN_ROUTE = {"request_id", "model", "token_ids", "sampling_params", "return_token_ids", "output_mode", "stream",
               "stream_options", "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
               "reasoning_ended", "reasoning_parser_kwargs", "token_offsets"}
"""The token route's (`/inference/v1/generate`, vLLM's GenerateRequest) top-level fields the proxy takes."""
SAMPLING_NEUTRAL = {"ignore_eos": (False,), "min_tokens": (0,), "prompt_logprobs": (), "allowed_token_ids": (),
                    "bad_words": ([],), "structured_outputs": (), "truncate_prompt_tokens": (),
                    "guided_decoding": (), "logits_processors": ()}
"""vLLM sampling parameters accepted only at their neutral value (None is always neutral): each other value changes
which tokens can be sampled, or asks what dppo does not compute (prompt log-probs)."""
SAMPLING_IGNORED = {"detokenize", "spaces_between_special_tokens", "output_kind", "extra_args", "skip_reading_prefix_cache",
                    "flat_logprobs"}


def check_generate(body: Any, *, temperature: float, top_k: int, stop_ids) -> tuple[Request, str, str]:
    """A `POST /inference/v1/generate` body (vLLM's token route, as `renderers` and prime-rl send it) checked as a
    completions call on its `token_ids` (`sampling_params` read as the completions fields): (Request, request_id,
    output_mode); RequestError naming the field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in body:
        if key not in TOKEN_ROUTE:
            raise RequestError(f"{key}: not supported by dppo's proxy", key, code="unsupported_parameter")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise RequestError("sampling_params: expected an object", "sampling_params")
    flat: dict = {}
    for key, value in sampling.items():
        where = f"sampling_params.{key}"
        if key in SAMPLING_IGNORED or value is None:
            continue
        if key in SAMPLING_NEUTRAL:
            if value not in SAMPLING_NEUTRAL[key]:
                raise RequestError(f"{where}: {value!r} refused: it changes which tokens can be sampled (µ) or asks "
                                   "for what dppo does not record", where, code="unsupported_parameter")
            continue
        flat[key] = value
    if flat.get("logprobs") is not None and flat.get("logprobs") is not False:
        flat["logprobs"] = int(flat["logprobs"]) if not isinstance(flat["logprobs"], bool) else 0
    mode = body.get("output_mode", "tokens")
    if mode not in ("tokens", "text"):
        raise RequestError(f"output_mode: expected 'tokens' or 'text', got {mode!r}", "output_mode")
    ids = body.get("token_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise RequestError("token_ids: expected a non-empty list of token ids", "token_ids")
    flat.update({k: body[k] for k in ("stream", "stream_options", "cache_salt", "priority", "model",
                                      "return_token_ids") if k in body})
    try:
        req = check_request({**flat, "prompt": ids}, "completions", temperature=temperature, top_k=top_k,
                            stop_ids=stop_ids)
    except RequestError as err:  # name the field where the client put it
        if err.param in sampling:
            err.param = f"sampling_params.{err.param}"
            err.args = (f"sampling_params.{err}",)
        raise
    request_id = body.get("request_id")
    return req, str(request_id) if request_id is not None else "", mode


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


__all__ = ["IGNORED", "NEUTRAL", "Request", "RequestError", "check_generate", "check_request"]
