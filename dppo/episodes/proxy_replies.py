"""The agent proxy's answers beyond the text, in the shapes the field's clients parse: µ and µ's top-K cells as OpenAI
log-probs (chat: `choices[].logprobs.content`; completions: `tokens` / `token_logprobs` / `top_logprobs`), the token
ids vLLM returns on `return_token_ids`, and a whole answer as a Server-Sent-Events stream (`stream: true`).

What is returned is what was recorded for training: `logprob` is log µ(a_t) of the temperature-scaled distribution the
token was sampled from (`Rollout.rollout_logp`), `top_logprobs` its first N of µ's recorded top-K cells, sorted by µ
(`Rollout.rollout_topk_*`), so a client that reads them sees the trust region's anchor exactly.
"""

from __future__ import annotations

import json
from typing import Iterator

from dppo.rollout.base import Rollout


def _names(tokenizer, result: Rollout, top: int, as_ids: bool) -> dict[int, str]:
    """Each token id of the answer (generated, and µ's first `top` cells) -> its name: `token_id:<id>`, or its text
    (one batched decode)."""
    ids = set(result.response_ids.tolist())
    if top and result.rollout_topk_ids is not None:
        ids |= set(result.rollout_topk_ids[:, :top].flatten().tolist())
    ids = sorted(ids)
    if as_ids:
        return {i: f"token_id:{i}" for i in ids}
    return dict(zip(ids, tokenizer.batch_decode([[i] for i in ids])))


def _cells(result: Rollout, t: int, n: int) -> list[tuple[int, float]]:
    """µ's first `n` recorded top cells at position `t` (id, log µ), by µ descending."""
    if n < 1 or result.rollout_topk_ids is None:
        return []
    ids, logp = result.rollout_topk_ids[t, :n].tolist(), result.rollout_topk_logp[t, :n].tolist()
    return list(zip(ids, logp))


def chat_logprobs(result: Rollout, tokenizer, top: int, as_ids: bool) -> dict:
    """`choices[].logprobs` of a chat completion: one entry per generated token."""
    content, names = [], _names(tokenizer, result, top, as_ids)
    for t, (token_id, logp) in enumerate(zip(result.response_ids.tolist(), result.rollout_logp.tolist())):
        name = names[token_id]
        tops = [{"token": names[i], "logprob": lp, "bytes": list(names[i].encode())} for i, lp in _cells(result, t, top)]
        content.append({"token": name, "logprob": logp, "bytes": list(name.encode()), "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(result: Rollout, tokenizer, top: int, as_ids: bool) -> dict:
    """`choices[].logprobs` of a (legacy) completion: parallel lists, `top_logprobs` one {token: logprob} per token."""
    tokens, offsets, offset, names = [], [], 0, _names(tokenizer, result, top, as_ids)
    for token_id in result.response_ids.tolist():
        tokens.append(names[token_id])
        offsets.append(offset)
        offset += len(tokens[-1])
    tops = [{names[i]: lp for i, lp in _cells(result, t, top)} or None for t in range(len(tokens))] if top else None
    return {"tokens": tokens, "token_logprobs": result.rollout_logp.tolist(), "top_logprobs": tops,
            "text_offset": offsets}


def generate_logprobs(result: Rollout, top: int) -> dict:
    """`choices[].logprobs` of the token route (vLLM's GenerateLogProbs): token ids, not strings; `top_logprobs` a
    list ranked by µ. Each entry also names its token `token_id:<id>`, the form `renderers` (verifiers' TrainClient,
    prime-rl) checks against the returned ids."""
    content = []
    for t, (token_id, logp) in enumerate(zip(result.response_ids.tolist(), result.rollout_logp.tolist())):
        tops = [{"token_id": i, "token": f"token_id:{i}", "logprob": lp, "rank": rank}
                for rank, (i, lp) in enumerate(_cells(result, t, top), 1)]
        content.append({"token_id": token_id, "token": f"token_id:{token_id}", "logprob": logp, "top_logprobs": tops})
    return {"content": content}


def sse_events(reply: dict, endpoint: str, include_usage: bool) -> Iterator[str]:
    """A finished answer (`reply`, the JSON a non-streaming call gets) as the events of an OpenAI stream: the
    content (chat: a delta with the role, the text and any tool calls; completions: the text), then the finish
    reason, then (`include_usage`) a chunk with the usage and no choices, then `[DONE]`."""
    choice = reply["choices"][0]
    head = {"id": reply.get("id"), "created": reply["created"], "model": reply["model"],
            "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion"}
    usage = {"usage": None} if include_usage else {}
    extra = {k: choice[k] for k in ("token_ids",) if k in choice}
    if endpoint == "generate":  # vLLM's token route: GenerateStreamResponse chunks
        head = {"request_id": reply["request_id"], "output_mode": reply["output_mode"]}
        first = {k: v for k, v in choice.items() if k != "finish_reason"} | {"finish_reason": None}
        last = {"index": 0, "token_ids": [], "finish_reason": choice["finish_reason"]}
    elif endpoint == "chat":
        message = choice["message"]
        delta = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None, **extra}
        last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    else:
        first = {"index": 0, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None, **extra}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    prompt_ids = {k: reply[k] for k in ("prompt_token_ids",) if k in reply}
    for body in ({**head, **prompt_ids, "choices": [first], **usage}, {**head, "choices": [last], **usage}):
        yield f"data: {json.dumps(body)}\n\n"
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"


__all__ = ["chat_logprobs", "completion_logprobs", "generate_logprobs", "sse_events"]
