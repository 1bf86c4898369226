"""The minimal agent service of docs/agents.md ("Agents behind HTTP"), run as the page prints it (taken from the
markdown; only its last line, `serve_forever` on port 8100, is replaced by a server on a free port): it plays
raw-text prompts (the smoke preset's `addition`, a string) and chat prompts (a list of messages), and trains two
steps on the smoke preset; an error inside it is answered 500 and dppo names it. And what dppo says about a service
that gives no reply at all: a handler that raises (the connection closed without a status), a process killed
mid-reply (a `ReadError` whose message is empty)."""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from dppo.episodes.agent_service import ServiceError, service_agent
from dppo.episodes.results import first_rows
from dppo.episodes.settings import AgentSettings, ProxySettings
from dppo.example import Example
from dppo.rollout.hf import HFEngine
from test_agent_loop import EXAMPLES, model, params  # noqa: F401 - `model` is a fixture

DOCS = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
RAW = [Example(prompt="2+3=", answer="5"), Example(prompt="17+34=", answer="51")]


def docs_service_code() -> ast.Module:
    """The docs' service (the first python block after "A minimal service"), without its last statement, which
    serves it forever on port 8100."""
    text = DOCS.read_text()
    start = re.search(r"A\s+minimal service", text).start()
    code = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    tree = ast.parse(code)
    last = tree.body[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last).endswith(".serve_forever()"), ast.unparse(last)
    tree.body.pop()
    return tree


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/episode"


@pytest.fixture(scope="module")
def docs_service():
    namespace: dict = {"__name__": "docs_service"}
    exec(compile(docs_service_code(), str(DOCS), "exec"), namespace)  # noqa: S102 - the docs' own code, run as printed
    server, url = serve(namespace["Episode"])
    yield url
    server.shutdown()
    server.server_close()


def collect(url: str, model, tokenizer, examples):
    collector = AgentSettings(url=url).episodes(max_new_tokens=8, proxy=ProxySettings(max_tokens=128)).collector()
    try:
        return collector(HFEngine(model, tokenizer), examples, params(n=2))
    finally:
        collector.close()


@pytest.mark.parametrize("examples", [RAW, EXAMPLES], ids=["raw_text_prompt", "chat_prompt"])
def test_the_docs_service_plays_raw_text_and_chat_prompts(docs_service, model, tokenizer, examples):
    episodes = first_rows(collect(docs_service, model, tokenizer, examples))
    assert len(episodes) == 4
    assert all(r.episode.error is None for r in episodes), [r.episode.error for r in episodes]
    assert all(r.episode.turns == 1 and r.reward in (0.0, 1.0) for r in episodes)


def test_the_docs_service_trains_two_steps_on_the_smoke_presets_raw_text_task(docs_service, tmp_path):
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, agent={"url": docs_service}, proxy={"max_tokens": 120},
                       rollout={"episodes": "agent", "engine": "hf", "dtype": "float32", "max_new_tokens": 4},
                       train={"threads": 1, "steps": 2})
    assert cfg.task.name == "addition"  # raw-text prompts: "12+34=", no chat messages
    trainer = Trainer(cfg, run_dir=tmp_path)
    try:
        metrics = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    errors = [line for line in (tmp_path / "samples.jsonl").read_text().splitlines() if "<error>" in line]
    assert not errors, [e[e.index("<error>"):][:300] for e in errors]
    assert all(m["episode/turns_mean"] == 1.0 and m["episode/env_errors"] == 0 for m in metrics)


def fake_client(base: str):
    """What service_agent reads of the episode's OpenAI client: its base URL and key."""
    return SimpleNamespace(base_url=f"{base}/e/KEY/v1", api_key="RUN-KEY")


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # (closed again: nothing listens there)


def test_an_error_inside_the_docs_service_is_answered_500_and_named(docs_service):
    agent = service_agent(docs_service, retries=0)
    client = fake_client(f"http://127.0.0.1:{unused_port()}")  # the service's model calls cannot connect
    with pytest.raises(ServiceError, match=r"status 500: .*APIConnectionError"):
        asyncio.run(agent(client, RAW[0]))


class Raises(BaseHTTPRequestHandler):
    """A handler that raises (as the docs' first service did on a raw-text prompt): http.server closes the
    connection without any reply."""

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def handle_error(self, *args) -> None:  # (quiet)
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        raise TypeError("messages must be a list")


class Killed(BaseHTTPRequestHandler):
    """A service killed while it runs the episode: the connection is reset under the client's read."""

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"rew")  # a reply cut short,
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # then a reset
        self.connection.close()
        self.close_connection = True


@pytest.mark.parametrize("handler, says", [
    (Raises, r"no reply: RemoteProtocolError: Server disconnected"),
    (Killed, r"no reply: (ReadError|RemoteProtocolError): \S"),  # (a ReadError's own message is empty)
])
def test_a_service_that_gives_no_reply_is_named_with_its_likely_causes(handler, says):
    server, url = serve(handler)
    try:
        with pytest.raises(ServiceError) as caught:
            asyncio.run(service_agent(url, retries=0)(fake_client("http://127.0.0.1:1"), RAW[0]))
    finally:
        server.shutdown()
        server.server_close()
    message = str(caught.value)
    assert message.startswith(f"{url}: ") and re.search(says, message), message
    assert "its process died, or its handler raised" in message
