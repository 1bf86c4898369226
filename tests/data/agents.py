"""Agents for tests/episodes/test_agent_loop.py, loaded by file path as a user's are (`path/to/agents.py:name`)."""

import json
import time

import httpx


def _question(example):
    return example.prompt[-1]["content"]


def two_calls(client, example):
    """Ask, then say "again" and ask once more (the second call extends the first: one row)."""
    messages = [{"role": "user", "content": _question(example)}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})
    second = client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") > 3)


async def two_calls_async(client, example):
    messages = [{"role": "user", "content": _question(example)}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") > 3)


def edits_history(client, example):
    """The second call changes the first reply before sending it back: not an extension, a new row. Reward: 0.5,
    or (`metadata["vary"]`, or a raw-text task) the first reply's length mod 3."""
    prompt = example.prompt
    messages = [{"role": "user", "content": prompt if isinstance(prompt, str) else _question(example)}]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
    messages.append({"role": "assistant", "content": "edited"})
    messages.append({"role": "user", "content": "again"})
    client.chat.completions.create(model="policy", messages=messages)
    return float(len(first) % 3) if isinstance(prompt, str) else 0.5


def completions_ids(client, example):
    """Token-id prompts on /v1/completions: the second extends the first's prompt + completion by raw ids."""
    prompt = [5, 6, 7]
    first = client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    choice = first.choices[0]
    ids = example.metadata["ids_of"](choice.text) + ([1] if choice.finish_reason == "stop" else [])  # (1: the EOS)
    client.completions.create(model="policy", prompt=prompt + ids + [8, 9], max_tokens=4)
    return 1.0


def raises(client, example):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": _question(example)}])
    raise RuntimeError("boom")


def hangs(client, example):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": _question(example)}])
    time.sleep(30)
    return 1.0


def returns_garbage(client, example):
    return "high"


def malformed_then_fine(client, example):
    """Sends a body that is not JSON and one with an unknown field (both refused), then a good call."""
    base = str(client.base_url).rstrip("/")
    bad = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=10)
    unknown = httpx.post(f"{base}/chat/completions", timeout=10,
                         json={"messages": [{"role": "user", "content": "x"}], "frobnicate": 1})
    assert bad.status_code == 400 and unknown.status_code == 400, (bad.text, unknown.text)
    assert unknown.json()["error"]["param"] == "frobnicate"
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": _question(example)}])
    return 1.0


def posts_reward(client, example):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": _question(example)}])
    base = str(client.base_url).rstrip("/")
    answer = httpx.post(f"{base[:-len('/v1')]}/reward", json={"reward": 0.25}, timeout=10)
    assert answer.status_code == 200, answer.text
    return None


def one_call(client, example):
    """A single answer scored like the addition task (the leading digits equal the answer)."""
    reply = client.completions.create(model="policy", prompt=example.prompt, max_tokens=example.metadata.get("T", 6))
    text = reply.choices[0].text
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return float(digits == example.answer)


def scripted(client, example, calls: int = 3):
    """tests/data/scripted_env.py:Scripted (3 turns) written as an agent: each reply but the last is answered by a
    tool message `result <t>`; the reward is the number of digits the model wrote."""
    prompt = example.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    digits = 0
    for t in range(1, calls + 1):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        digits += sum(c.isdigit() for c in reply.content or "")
        messages.append(reply.model_dump(exclude_none=True))
        if t < calls:
            messages.append({"role": "tool", "content": f"result {t}"})
    return float(digits)


def six_calls(client, example):
    """`scripted` with 6 calls: more than env.max_turns' default (4)."""
    return scripted(client, example, calls=6)


def asks_top_logprobs(client, example):
    """SkyRL's request: `logprobs: true, top_logprobs: 1`; raises (a failed episode) unless every token comes with µ's
    log-prob and its top-1 cell."""
    prompt = example.prompt if isinstance(example.prompt, str) else example.prompt[-1]["content"]
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}],
                                           logprobs=True, top_logprobs=1)
    tokens = reply.choices[0].logprobs.content
    if not tokens or any(len(t.top_logprobs) != 1 for t in tokens):
        raise ValueError(f"top_logprobs not answered: {tokens}")
    return 1.0
