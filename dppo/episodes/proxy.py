"""The recording proxy's HTTP side: an OpenAI-compatible endpoint in front of a dppo engine, recording every call.

    proxy = Proxy(agent_settings); proxy.start()   # uvicorn in a background thread (FastAPI app)
    ep = proxy.open(prompt_index, example)                         # an episode; its base URL: proxy.base_url(ep)
    proxy.begin(engine, params)                                    # a collection starts
    ... agents call /e/<episode key>/v1/chat/completions ...       # (run on proxy.loop)
    proxy.serve(engine, params, active=..., finished=...)          # THIS thread runs the engine until agents finish
    proxy.close_episodes()

The proxy takes the run's `agent` settings (`dppo.episodes.settings.AgentSettings`, a row's token budget
among them) as they are, and the batch wait as an argument. Endpoints, under each episode's base URL
`http://<host>:<port>/e/<key>/v1`: `POST chat/completions`, `POST completions`, `GET models`; and
`POST /e/<key>/reward` (`{"reward": float}`) for an agent that reports its reward instead of returning it. An
unknown or ended episode gets 404 / 410; a request over `agent.max_request_bytes` 413; more than
`agent.max_concurrent_requests` requests in flight 429; a refused sampling parameter 400 with the OpenAI error shape
(`dppo.episodes.proxy_requests`). When the proxy binds to anything but the loopback interface, every request needs
`Authorization: Bearer <the run's key>` (401 otherwise); on localhost the episode's random key in its URL is the
credential.

Each call is placed in its episode's rows (`dppo.episodes.agent_rows`), answered by the engine together with the
other episodes' calls (`dppo.episodes.proxy_batching`), and its generated ids, µ, µ's top-K cells and per-token
weight versions are recorded into its row.
"""

import asyncio
import copy
import ipaddress
import json
import secrets
import threading
import time
from typing import Any, Callable

from dppo.episodes.agent_rows import ProxyEpisode
from dppo.episodes.chat import ChatCodec, reply_message
from dppo.episodes.proxy_batching import Batcher
from dppo.episodes.proxy_requests import RequestError, check_request
from dppo.rollout.base import SamplingParams

MODEL_NAME = "dppo-policy"
"""The model name `GET models` lists (any name a request sends is the run's policy)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Proxy:
    """See the module docstring. State: the episodes of the current collection and the calls in flight."""

    def __init__(self, settings, *, batch_wait_s: float = 0.2) -> None:
        """`settings`: the run's `dppo.episodes.settings.AgentSettings` (a row's response tokens: its max_tokens);
        `batch_wait_s`: the longest wait for the other episodes' calls (`Batcher`)."""
        self.settings, self.max_tokens = settings, settings.max_tokens
        self.batcher = Batcher(batch_wait_s)
        self.key = secrets.token_urlsafe(24)
        """The run's key (needed in `Authorization` when the proxy is exposed beyond localhost)."""
        self.episodes: dict[str, ProxyEpisode] = {}
        self.codec: ChatCodec | None = None
        self._source = None
        self.params: SamplingParams | None = None
        self._in_flight = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def batch_sizes(self) -> list[int]:
        """Calls per engine call, every engine call of the proxy's life (benchmarks and tests read it)."""
        return self.batcher.batch_sizes

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        import uvicorn

        ready = threading.Event()
        config = uvicorn.Config(self._app(), host=self.settings.host, port=self.settings.port, log_level="warning",
                                access_log=False, lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_until_complete(self._server.serve())

        self._thread = threading.Thread(target=run, name="dppo-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"agent proxy: could not listen on {self.settings.host}:{self.settings.port} "
                                   "(port in use? set agent.port)")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def base_url(self, episode: ProxyEpisode) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}/e/{episode.key}/v1"

    def open(self, prompt_index: int, example) -> ProxyEpisode:
        ep = ProxyEpisode(prompt_index, example, secrets.token_urlsafe(12), order=len(self.episodes))
        self.episodes[ep.key] = ep
        return ep

    def close_episodes(self) -> None:
        """End every episode of the collection (their later calls get 404)."""
        for ep in self.episodes.values():
            ep.closed = True
        self.episodes = {}

    # ------------------------------------------------------------------ the engine side (the caller's thread)
    def begin(self, engine, params: SamplingParams) -> None:
        """A collection starts: calls are answered at `params`' temperature and budget, rendered with `engine`'s
        tokenizer (a copy: the engine may use its own from the serving thread meanwhile)."""
        if self._source is not engine.tokenizer:
            self.codec = ChatCodec(copy.deepcopy(engine.tokenizer), append_only=False)
            self._source = engine.tokenizer
        self.params = params

    def serve(self, engine, params: SamplingParams, *, active: Callable[[], int], finished: Callable[[], bool],
              prefix_tokens: int = 0) -> None:
        """Answer calls with `engine` until `finished()` (every episode ended) and no call waits
        (`dppo.episodes.proxy_batching.Batcher.serve`: `active()` episodes running)."""
        try:
            self.batcher.serve(engine, params, active=active, finished=finished, prefix_tokens=prefix_tokens)
        finally:
            self.params = None

    def wake(self) -> None:
        """An episode ended: the serving thread re-checks whether the batch is complete."""
        self.batcher.wake()

    # ------------------------------------------------------------------ the HTTP side (the proxy's loop)
    def _app(self):  # (annotations evaluated at definition: FastAPI reads `Request` from them)
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="dppo agent proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def refused(_request, err: RequestError):
            return JSONResponse(err.body(), status_code=err.status)

        @app.post("/e/{key}/v1/chat/completions")
        async def chat(key: str, request: Request):
            return await self._handle(key, request, "chat")

        @app.post("/e/{key}/v1/completions")
        async def completions(key: str, request: Request):
            return await self._handle(key, request, "completions")

        @app.get("/e/{key}/v1/models")
        async def models(key: str, request: Request):
            self._episode(key, request)
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "dppo"}]}

        @app.post("/e/{key}/reward")
        async def reward(key: str, request: Request):
            ep = self._episode(key, request)
            body = await self._body(request)
            value = body.get("reward") if isinstance(body, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
                raise RequestError("reward: expected a finite number", "reward")
            ep.posted = float(value)
            return {"ok": True}

        return app

    def _episode(self, key: str, request) -> ProxyEpisode:
        if not is_loopback(self.settings.host):
            auth = request.headers.get("authorization", "")
            if not secrets.compare_digest(auth, f"Bearer {self.key}"):
                raise RequestError("a valid API key is required (the run's key)", None, code="invalid_api_key",
                                   status=401)
        ep = self.episodes.get(key)
        if ep is None:
            raise RequestError("no such episode (it ended, or the URL is wrong)", None, code="not_found", status=404)
        if ep.closed:
            raise RequestError("this episode has ended", None, code="episode_ended", status=410)
        return ep

    async def _body(self, request) -> Any:
        cap = self.settings.max_request_bytes
        if int(request.headers.get("content-length") or 0) > cap:
            raise RequestError(f"the request is larger than {cap} bytes (agent.max_request_bytes)", None,
                               code="request_too_large", status=413)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > cap:
                raise RequestError(f"the request is larger than {cap} bytes (agent.max_request_bytes)", None,
                                   code="request_too_large", status=413)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not JSON: {e}") from e

    async def _handle(self, key: str, request, endpoint: str):
        ep = self._episode(key, request)
        limit = self.settings.max_concurrent_requests
        if self._in_flight >= limit:
            raise RequestError(f"more than {limit} requests in flight", None, code="rate_limit_exceeded", status=429)
        self._in_flight += 1
        try:
            return await self._answer(ep, await self._body(request), endpoint)
        except RequestError:
            ep.refused += 1
            raise
        finally:
            self._in_flight -= 1

    async def _answer(self, ep: ProxyEpisode, body: Any, endpoint: str) -> dict:
        codec = self.codec
        if codec is None or self.params is None:
            raise RequestError("the proxy is not serving (no collection running)", None, code="not_serving", status=503)
        req = check_request(body, endpoint, temperature=self.params.temperature)
        if ep.calls >= self.settings.max_calls:
            raise RequestError(f"this episode made its {self.settings.max_calls} calls (agent.max_calls)", None,
                               code="max_calls")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = codec.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt is not None and (min(prompt) < 0 or max(prompt) >= len(codec.tokenizer)):
            raise RequestError("prompt: token ids outside the vocabulary", "prompt")
        try:
            row, extra, new = ep.place(req.messages, req.tools, prompt, codec)
        except Exception as err:  # noqa: BLE001 - the model's chat template refused these messages (a jinja error)
            raise RequestError(f"messages: the model's chat template cannot render them: {type(err).__name__}: "
                               f"{err}", "messages") from err
        room = self.max_tokens - len(row.tokens.ids) - len(extra)
        max_new = min(req.max_tokens or self.params.max_new_tokens, self.params.max_new_tokens, room)
        if max_new < 1:
            ep.truncated += 1
            raise RequestError(f"this episode's row holds {len(row.tokens.ids) + len(extra)} response tokens, its "
                               f"budget is {self.max_tokens} (agent.max_tokens)", "messages",
                               code="context_length_exceeded")
        row.busy = True
        try:
            result = await self.batcher.submit(ep, row.tokens.context() + extra, max_new)
        finally:
            row.busy = False
        if ep.closed:
            raise RequestError("this episode has ended", None, code="episode_ended", status=410)
        return self._reply(ep, row, extra, new, req, result, endpoint)

    def _reply(self, ep: ProxyEpisode, row, extra: list[int], new: bool, req, result, endpoint: str) -> dict:
        """Record the call into its row and answer it in the endpoint's OpenAI shape."""
        tok = self.codec.tokenizer
        ep.record(row, extra, new, result, tok.eos_token_id)
        ids = result.response_ids.tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        context = len(row.tokens.context())
        usage = {"prompt_tokens": context - len(ids), "completion_tokens": len(ids), "total_tokens": context}
        ident = f"{ep.key}-{ep.calls}"
        if endpoint == "completions":
            return {"id": f"cmpl-{ident}", "object": "text_completion", "created": int(time.time()),
                    "model": MODEL_NAME, "usage": usage,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": "length" if result.finish_reason == "length" else "stop"}]}
        message, kind = reply_message(text, ep.tool_calls)
        ep.tool_calls += len(message.get("tool_calls") or [])
        row.remember(req.messages, text, message, new=new)
        finish = "length" if result.finish_reason == "length" else kind
        return {"id": f"chatcmpl-{ident}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "usage": usage,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]}


__all__ = ["MODEL_NAME", "Proxy", "is_loopback"]
