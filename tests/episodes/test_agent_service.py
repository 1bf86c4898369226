"""Agents behind HTTP (`dppo.episodes.agent_service`, agent.url): a service written here with the standard library
(no dppo code), posted each episode's example, base URL and key, trains through the proxy like an agent function;
a reward posted instead of returned counts; a post that did not reach the service is retried; a service that dies
mid-episode, is unreachable or answers garbage fails only its episodes, counted and named; the trainer trains 2 steps
on a service."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import torch

from dppo.episodes.results import first_rows
from dppo.episodes.settings import AgentSettings, ProxySettings
from dppo.rollout.hf import HFEngine
from dppo.train.config import ConfigError
from test_agent_loop import EXAMPLES, model, params  # noqa: F401 - `model` is a fixture

SEEN: list[dict] = []


class Agent(BaseHTTPRequestHandler):
    """The service: `behaviour` (the URL's path) decides what it does with an episode."""

    attempts: dict[str, int] = {}

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        SEEN.append(body)
        behaviour = self.path.strip("/")
        episode = body["episode"]
        Agent.attempts[episode] = Agent.attempts.get(episode, 0) + 1
        if behaviour == "flaky" and Agent.attempts[episode] == 1:
            return self._answer(503, {"error": "warming up"})
        client = openai.OpenAI(base_url=body["base_url"], api_key=body["api_key"], max_retries=0)
        prompt = body["example"]["prompt"]  # chat messages, or a raw string (a task without a chat template)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        if behaviour == "dies":  # the service's process goes away mid-episode: the connection drops, no answer
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return None
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
        client.chat.completions.create(model="policy", messages=messages)
        if behaviour == "garbage":
            return self._answer(200, {"score": 1})
        if behaviour == "posts":
            httpx.post(body["reward_url"], json={"reward": 2.0}, headers={"Authorization": f"Bearer {body['api_key']}"})
            return self._answer(200, {"reward": None})
        return self._answer(200, {"reward": 1.0 + len(body["example"]["answer"])})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Server(ThreadingHTTPServer):
    """The standard library's threading server with a listen backlog for a step's episodes (its default, 5, resets
    connections when a trainer step posts 16 episodes at once on a loaded machine; uvicorn's is 2048)."""

    request_queue_size = 128
    daemon_threads = True


@pytest.fixture(scope="module")
def service():
    server = Server(("127.0.0.1", 0), Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def collect(url: str, model, tokenizer, **agent):
    episodes = AgentSettings(url=url, **agent).episodes(max_new_tokens=8, proxy=ProxySettings(max_tokens=128))
    collector = episodes.collector()
    try:
        return collector(HFEngine(model, tokenizer), EXAMPLES, params(n=2))
    finally:
        collector.close()


def test_a_service_trains_through_the_proxy_like_an_agent_function(service, model, tokenizer):
    SEEN.clear()
    rows = collect(f"{service}/ok", model, tokenizer)
    episodes = first_rows(rows)
    assert len(episodes) == 4 and all(r.episode.error is None and r.episode.turns == 2 for r in episodes)
    assert sorted(r.reward for r in episodes) == [2.0, 2.0, 3.0, 3.0]  # 1 + len(answer): "5", "51"
    assert all(r.row == 0 for r in rows) and all(int(r.loss_mask.sum()) >= 2 for r in rows)
    assert len(SEEN) == 4  # (posted concurrently: in any order)
    body = next(b for b in SEEN if b["example"]["answer"] == "5")
    assert body["example"]["prompt"] == [dict(m) for m in EXAMPLES[0].prompt]
    assert body["base_url"].endswith(f"/e/{body['episode']}/v1") and body["reward_url"].endswith("/reward")


def test_a_reward_posted_instead_of_returned_counts(service, model, tokenizer):
    rows = collect(f"{service}/posts", model, tokenizer)
    assert [r.reward for r in first_rows(rows)] == [2.0] * 4


def test_a_post_that_did_not_reach_the_service_is_retried(service, model, tokenizer):
    Agent.attempts.clear()
    rows = collect(f"{service}/flaky", model, tokenizer)
    assert all(r.episode.error is None for r in first_rows(rows)) and set(Agent.attempts.values()) == {2}
    Agent.attempts.clear()
    rows = collect(f"{service}/flaky", model, tokenizer, post_retries=0)
    assert all("status 503" in r.episode.error and r.reward == 0.0 for r in first_rows(rows))


def test_a_service_that_dies_mid_episode_fails_only_its_episodes_counted(service, model, tokenizer):
    rows = collect(f"{service}/dies", model, tokenizer)
    episodes = first_rows(rows)
    assert all(r.reward == 0.0 and r.episode.env_errors == 1.0 and service in r.episode.error for r in episodes)
    assert all(r.episode.turns == 1 for r in episodes)  # the call it made is recorded (its µ stays exact)
    rows = collect(f"{service}/garbage", model, tokenizer)
    assert all("expected {\"reward\"" in r.episode.error for r in first_rows(rows))


def test_an_unreachable_service_is_retried_then_fails_its_episodes_and_the_collection_goes_on(model, tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    rows = collect(f"http://127.0.0.1:{port}/agent", model, tokenizer, post_retries=1)
    episodes = first_rows(rows)
    assert len(episodes) == 4 and all("not reachable after 2 tries" in r.episode.error for r in episodes)
    assert all(r.reward == 0.0 and r.episode.env_errors == 1.0 for r in episodes)


def test_agent_url_settings_are_checked():
    with pytest.raises(ConfigError, match=r"^agent\.url: an agent is a function"):
        AgentSettings(name="a.py:f", url="http://127.0.0.1:1/")
    with pytest.raises(ConfigError, match=r"^agent\.url: expected an http"):
        AgentSettings(url="ftp://x")
    with pytest.raises(ConfigError, match=r"^agent\.post_retries"):
        AgentSettings(url="http://x", post_retries=-1)


def test_the_trainer_trains_two_steps_on_an_agent_service(service, tmp_path):
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, agent={"url": f"{service}/ok"}, proxy={"max_tokens": 120},
                       rollout={"episodes": "agent", "engine": "hf", "dtype": "float32", "max_new_tokens": 4},
                       train={"threads": 1, "steps": 2})
    trainer = Trainer(cfg, run_dir=tmp_path)
    try:
        metrics = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    summary = [(m["episode/turns_mean"], m["episode/env_errors"]) for m in metrics]
    errors = [line for line in (tmp_path / "samples.jsonl").read_text().splitlines() if "<error>" in line]
    assert all(s == (2.0, 0) for s in summary), (summary, [e[e.index("<error>"):][:300] for e in errors])
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
