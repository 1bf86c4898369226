"""Agents behind HTTP (agent.url): an agent that runs as a service, in another process or on another machine, trained
through the recording proxy like an agent function.

For each episode dppo posts to the service's URL

    {"example": {"prompt": [...], "answer": "...", "metadata": {...}}, "base_url": "http://<proxy>/e/<key>/v1",
     "api_key": "<the run's key>", "reward_url": "http://<proxy>/e/<key>/reward", "episode": "<key>"}

and the service runs its agent against `base_url` (an OpenAI-compatible endpoint: chat, completions, the token route;
`api_key` as the bearer token, which the proxy needs when it binds beyond localhost), then answers
`{"reward": <number>}`, or `{"reward": null}` after posting `{"reward": <number>}` to `reward_url`. A post that did
not reach the service (connection refused or reset before it was sent, or 502 / 503 / 504 from a proxy in front of
it) is sent again, up to agent.post_retries times, with a growing pause: nothing of the episode ran yet. A service that
dies while it runs an episode (the connection drops, an error status, a body that is no reward) ends that episode
with reward 0, counted and named like an agent function that raised (`episode/env_errors`): the error names the URL
and, for an error status, the status and the start of the body; a connection closed without any reply says so and
why it usually happens (`NO_REPLY_HINT`). proxy.timeout_s bounds the whole episode. The run goes on. A minimal
service is in docs/agents.md ("Agents behind HTTP").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dppo.episodes.errors import describe_error

RETRIED_STATUS = (502, 503, 504)
"""Statuses that mean the post did not reach the service (a gateway in front of it): retried."""


def example_payload(example) -> dict:
    """The example as JSON: its prompt, answer and the JSON-safe part of its metadata."""
    prompt = example.prompt if isinstance(example.prompt, str) else [dict(m) for m in example.prompt]
    metadata = {}
    for key, value in (example.metadata or {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        metadata[key] = value
    return {"prompt": prompt, "answer": example.answer, "metadata": metadata, "uid": example.uid}


NO_REPLY_HINT = ("the service closed the connection without answering: its process died, or its handler raised "
                 "(Python's http.server then closes the connection without a status; answer 500 with the error "
                 "instead, which dppo shows); see the service's log")
"""What a post that got no reply at all says about the likely causes."""


class ServiceError(RuntimeError):
    """The agent service failed the episode (the message says how)."""


def service_agent(url: str, *, retries: int = 2, backoff_s: float = 0.5):
    """An async agent function `(client, example) -> reward | None` that hands the episode to the service at `url`
    (module docstring). `client` is the episode's OpenAI client: its base URL and key are what the service gets."""

    async def agent(client, example) -> Any:
        import httpx

        base = str(client.base_url).rstrip("/")
        payload = {"example": example_payload(example), "base_url": base, "api_key": client.api_key,
                   "reward_url": base.removesuffix("/v1") + "/reward", "episode": base.rstrip("/").split("/")[-2]}
        async with httpx.AsyncClient(timeout=None) as http:
            for attempt in range(retries + 1):
                try:
                    response = await http.post(url, json=payload)
                except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                    if attempt == retries:
                        raise ServiceError(f"{url}: not reachable after {retries + 1} tries: {err!r}") from err
                except httpx.TransportError as err:  # sent, then the connection dropped: not retried (it may have run)
                    raise ServiceError(f"{url}: no reply: {describe_error(err, url=url, peer='the agent service')}; "
                                       f"{NO_REPLY_HINT}") from err
                else:
                    if response.status_code not in RETRIED_STATUS or attempt == retries:
                        break
                await asyncio.sleep(backoff_s * 2 ** attempt)
        if response.status_code // 100 != 2:
            raise ServiceError(f"{url}: status {response.status_code}: {response.text[:300]}")
        try:
            body = response.json()
        except ValueError as err:
            raise ServiceError(f"{url}: the answer is not JSON: {response.text[:300]!r}") from err
        if not isinstance(body, dict) or "reward" not in body:
            raise ServiceError(f"{url}: expected {{\"reward\": number or null}}, got {str(body)[:300]}")
        return body["reward"]

    agent.__qualname__ = agent.__name__ = f"service({url})"
    return agent


__all__ = ["NO_REPLY_HINT", "RETRIED_STATUS", "ServiceError", "example_payload", "service_agent"]
