"""The recording proxy answers what the field's clients send (docs/agents.md, "What clients send"): raw JSON replays of
the requests prime-rl, SkyRL, NeMo Gym and verifiers' configs make by default are answered, not refused; µ and its
top-K cells returned through `logprobs` are the ones recorded for training (and a plain fp32 forward); the token ids
returned on `return_token_ids` are the row's; `stream: true` is an SSE stream that the `openai` client and a raw
reader both parse; `chat_template_kwargs` change the rendered prompt, which is recorded; what changes µ is still
refused, naming the field."""

from __future__ import annotations

import copy
import json
import threading

import httpx
import openai
import pytest
import torch

from dppo.episodes.proxy import Proxy
from dppo.episodes.settings import ProxySettings
from dppo.example import Example
from dppo.rollout.base import SamplingParams
from dppo.rollout.hf import HFEngine
from dppo.train.scoring import score_responses_reference

K = 4
EXAMPLE = Example(prompt=({"role": "user", "content": "2+3?"},), answer="5")
MESSAGES = [{"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def model(tiny_model, with_logit_bias):
    """The tiny model, never sampling pad / <|im_start|> / unk, stopping often."""
    return with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: 1.0})


def params() -> SamplingParams:
    return SamplingParams(n=1, max_new_tokens=8, top_k_logprobs=K, stop_token_ids=(1,), seed=3)


def serve(model, tokenizer, client_fn):
    """Run `client_fn(base_url)` in a thread against a proxy whose engine this thread serves; (its result, the
    episode, the proxy's tokenizer)."""
    proxy = Proxy(ProxySettings(max_tokens=128))
    proxy.start()
    out, done = {}, threading.Event()
    try:
        engine = HFEngine(model, tokenizer)
        proxy.begin(engine, params())
        ep = proxy.open(0, EXAMPLE)

        def client() -> None:
            try:
                out["result"] = client_fn(proxy.base_url(ep))
            except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
                out["error"] = err
            finally:
                done.set()
                proxy.wake()

        threading.Thread(target=client, daemon=True).start()
        proxy.serve(engine, params(), active=lambda: 0 if done.is_set() else 1, finished=done.is_set)
        done.wait(30)
    finally:
        proxy.stop()
    if "error" in out:
        raise out["error"]
    return out["result"], ep


def post(path: str, body: dict, headers: dict | None = None):
    return lambda url: httpx.post(f"{url}/{path}", json=body, headers=headers or {}, timeout=30)


# The requests as the clients send them by default (their sources are named in docs/agents.md's table).
REPLAYS = {
    "prime-rl": ("chat/completions", {"model": "policy", "messages": MESSAGES, "temperature": 1.0, "top_p": 1.0,
                                      "logprobs": True, "max_completion_tokens": 8, "n": 1}),
    "skyrl": ("chat/completions", {"model": "policy", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1,
                                   "return_tokens_as_token_ids": True, "skip_special_tokens": True,
                                   "include_stop_str_in_output": True, "max_tokens": 8}),
    "nemo-gym": ("chat/completions", {"model": "policy", "messages": MESSAGES, "logprobs": True, "top_logprobs": 0,
                                      "return_token_ids": True}),
    "verifiers-config": ("chat/completions", {"model": "policy", "messages": MESSAGES,
                                              "chat_template_kwargs": {"enable_thinking": False},
                                              "cache_salt": "abc", "priority": 0, "seed": 7,
                                              "stop_token_ids": [1]}),
    "completions": ("completions", {"model": "policy", "prompt": [5, 6, 7], "logprobs": 2, "return_token_ids": True,
                                    "max_tokens": 6}),
}


@pytest.mark.parametrize("client", sorted(REPLAYS))
def test_a_clients_default_request_is_answered_and_returns_what_it_asked_for(model, tokenizer, client):
    path, body = REPLAYS[client]
    response, ep = serve(model, tokenizer, post(path, body))
    assert response.status_code == 200, response.text
    reply = response.json()
    choice = reply["choices"][0]
    assert ep.calls == 1 and ep.refused == 0
    (row,) = ep.rows
    generated = [t for t, m in zip(row.tokens.ids, row.tokens.mask) if m]
    if body.get("return_token_ids"):
        assert choice["token_ids"] == generated
        prompt_ids = choice["prompt_token_ids"] if path == "completions" else reply["prompt_token_ids"]
        assert prompt_ids + generated == row.tokens.context()
    else:
        assert "token_ids" not in choice and "prompt_token_ids" not in reply
    if not body.get("logprobs") and body.get("logprobs") != 0:
        assert choice["logprobs"] is None
        return
    if path == "completions":
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(generated) and len(lp["top_logprobs"]) == len(generated)
        assert all(len(cells) == 2 for cells in lp["top_logprobs"])
        return
    content = choice["logprobs"]["content"]
    assert len(content) == len(generated)
    assert all(len(c["top_logprobs"]) == body.get("top_logprobs", 0) for c in content)
    if body.get("return_tokens_as_token_ids"):
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in generated]


def test_logprobs_returned_are_mu_as_recorded_and_a_plain_fp32_forward(model, tokenizer):
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": K, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "max_tokens": 8}
    response, ep = serve(model, tokenizer, post("chat/completions", body))
    reply = response.json()
    content = reply["choices"][0]["logprobs"]["content"]
    (row,) = ep.rollouts(eos_id=1, version=0)
    gen = row.loss_mask
    recorded = row.rollout_logp[gen]
    returned = torch.tensor([c["logprob"] for c in content])
    assert torch.equal(returned, recorded.float())
    top_ids = torch.tensor([[int(t["token"].split(":")[1]) for t in c["top_logprobs"]] for c in content])
    top_logp = torch.tensor([[t["logprob"] for t in c["top_logprobs"]] for c in content])
    assert torch.equal(top_ids, row.rollout_topk_ids[gen][:, :K])
    assert torch.equal(top_logp, row.rollout_topk_logp[gen][:, :K])
    # and they are the policy's: a plain fp32 forward of the prompt and the sampled tokens
    ids = torch.tensor(reply["prompt_token_ids"] + reply["choices"][0]["token_ids"])
    n = len(reply["prompt_token_ids"])
    ref = score_responses_reference(model, ids[None, :n], ids[None, n:], torch.ones(1, len(ids) - n, dtype=torch.bool),
                                    topk_ids=top_ids[None])
    assert torch.allclose(ref.logp[0], returned, rtol=0, atol=2e-5)
    assert torch.allclose(ref.topk_logp[0], top_logp, rtol=0, atol=2e-5)


def test_openai_stream_true_gets_the_whole_answer_and_the_usage(model, tokenizer):
    def stream(url):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(model="policy", messages=MESSAGES, stream=True, logprobs=True,
                                                     stream_options={"include_usage": True}))
        return chunks

    chunks, ep = serve(model, tokenizer, stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    (row,) = ep.rows
    generated = [t for t, m in zip(row.tokens.ids, row.tokens.mask) if m]
    assert text == tokenizer.decode(generated, skip_special_tokens=True)
    assert finish in (["stop"], ["length"])
    assert len(usage) == 1 and usage[0].completion_tokens == len(generated)
    assert usage[0].prompt_tokens + len(generated) == usage[0].total_tokens
    lp = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(lp) == 1 and [c.token for c in lp[0].content] == [tokenizer.decode([t]) for t in generated]


def test_a_raw_sse_reader_parses_a_completions_stream(model, tokenizer):
    def raw(url):
        with httpx.stream("POST", f"{url}/completions", json={"prompt": "ab", "stream": True, "max_tokens": 5},
                          timeout=30) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            return [line for line in response.iter_lines() if line]

    lines, ep = serve(model, tokenizer, raw)
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert [e["object"] for e in events] == ["text_completion", "text_completion"]
    (row,) = ep.rows
    generated = [t for t, m in zip(row.tokens.ids, row.tokens.mask) if m]
    assert "".join(e["choices"][0]["text"] for e in events) == tokenizer.decode(generated, skip_special_tokens=True)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_template_kwargs_change_the_rendered_prompt_which_is_recorded(model, tokenizer):
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = tokenizer.chat_template.replace(
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}",
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking %}{{ 'think:' }}{% endif %}")
    assert thinking.chat_template != tokenizer.chat_template
    prompts = {}
    for flag in (True, False):
        body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": flag}, "return_token_ids": True,
                "max_tokens": 2}
        response, ep = serve(model, thinking, post("chat/completions", body))
        prompts[flag] = thinking.decode(response.json()["prompt_token_ids"])
        assert ep.rows[0].tokens.context()[:len(response.json()["prompt_token_ids"])] == \
            response.json()["prompt_token_ids"]
    assert prompts[True] == prompts[False] + "think:"


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": K + 1}, "top_logprobs"), ({"stop_token_ids": [1, 9]}, "stop_token_ids"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": "yes"}, "logprobs"), ({"top_p": 0.9}, "top_p"),
    ({"temperature": 0.7}, "temperature"), ({"top_k": 5}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"n": 2}, "n"),
    ({"stop": ["x"]}, "stop"), ({"repetition_penalty": 1.1}, "repetition_penalty")])
def test_what_changes_mu_or_cannot_be_answered_is_still_refused_naming_the_field(model, tokenizer, body, param):
    response, ep = serve(model, tokenizer, post("chat/completions", {"messages": MESSAGES, **body}))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and param in error["message"]
    assert ep.refused == 1 and ep.calls == 0


def _generate_body(ids, **sampling):
    return {"token_ids": ids, "cache_salt": "s", "return_token_ids": True,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "logprobs": 1, "n": 1, "seed": 0,
                                "stop_token_ids": [1], "skip_special_tokens": False, "detokenize": False, **sampling}}


def test_the_token_route_answers_vllms_generate_shape_and_joins_a_rows_calls_by_prefix(model, tokenizer):
    first_ids = tokenizer.encode("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)

    def two_calls(url):
        one = httpx.post(f"{url.removesuffix('/v1')}/inference/v1/generate", json=_generate_body(first_ids),
                         timeout=30).json()
        ids = one["prompt_token_ids"] + one["choices"][0]["token_ids"] + tokenizer.encode("\nok", add_special_tokens=False)
        two = httpx.post(f"{url.removesuffix('/v1')}/inference/v1/generate", json=_generate_body(ids), timeout=30)
        return one, two.json()

    (one, two), ep = serve(model, tokenizer, two_calls)
    assert one["output_mode"] == "tokens" and one["prompt_token_ids"] == first_ids
    assert ep.calls == 2 and len(ep.rows) == 1  # the second call extends the first: one row
    (row,) = ep.rollouts(eos_id=1, version=0)
    gen = row.loss_mask
    returned = [c for reply in (one, two) for c in reply["choices"][0]["logprobs"]["content"]]
    assert [c["token_id"] for c in returned] == row.response_ids[gen].tolist()
    assert torch.equal(torch.tensor([c["logprob"] for c in returned]), row.rollout_logp[gen].float())
    tops = [(c["top_logprobs"][0]["token_id"], c["top_logprobs"][0]["logprob"], c["top_logprobs"][0]["rank"])
            for c in returned]
    assert [t[0] for t in tops] == row.rollout_topk_ids[gen][:, 0].tolist() and {t[2] for t in tops} == {1}
    assert two["usage"]["prompt_tokens"] == len(two["prompt_token_ids"])


def test_the_token_route_streams_and_refuses_naming_the_sampling_field(model, tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)

    def calls(url):
        root = url.removesuffix("/v1")
        refused = [httpx.post(f"{root}/inference/v1/generate", json=_generate_body(ids, **s), timeout=30).json()
                   for s in ({"top_k": 5}, {"min_tokens": 3}, {"logprobs": K + 1})]
        with httpx.stream("POST", f"{root}/inference/v1/generate", json={**_generate_body(ids), "stream": True},
                          timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        return refused, lines

    (refused, lines), ep = serve(model, tokenizer, calls)
    assert [r["error"]["param"] for r in refused] == ["sampling_params.top_k", "sampling_params.min_tokens",
                                                        "sampling_params.logprobs"]
    assert all(r["error"]["message"].startswith(r["error"]["param"]) for r in refused)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    (row,) = ep.rows
    generated = [t for t, m in zip(row.tokens.ids, row.tokens.mask) if m]
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == generated
    assert events[0]["prompt_token_ids"] == ids and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_one_shared_base_url_names_the_episode_by_its_session_header(model, tokenizer):
    def shared(url):
        root = url.split("/e/")[0]
        key = url.split("/e/")[1].split("/")[0]
        missing = httpx.post(f"{root}/v1/chat/completions", json={"messages": MESSAGES}, timeout=30)
        wrong = httpx.post(f"{root}/v1/chat/completions", json={"messages": MESSAGES},
                           headers={"X-Session-ID": "nope"}, timeout=30)
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0,
                               default_headers={"X-Session-ID": key})
        reply = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        return missing, wrong, reply

    (missing, wrong, reply), ep = serve(model, tokenizer, shared)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "X-Session-ID"
    assert wrong.status_code == 404
    assert ep.calls == 1 and reply.choices[0].message.content == tokenizer.decode(
        [t for t, m in zip(ep.rows[0].tokens.ids, ep.rows[0].tokens.mask) if m], skip_special_tokens=True)
