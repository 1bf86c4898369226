"""The recording proxy's HTTP side: an OpenAI-compatible endpoint in front of a dppo engine, recording every call.

    proxy = Proxy(proxy_settings); proxy.start()   # uvicorn in a background thread (FastAPI app)
    ep = proxy.open(prompt_index, example)                         # an episode; its base URL: proxy.base_url(ep)
    proxy.begin(engine, params)                                    # a collection starts
    ... agents call /e/<episode key>/v1/chat/completions ...       # (run on proxy.loop)
    proxy.serve(engine, params, active=..., finished=...)          # THIS thread runs the engine until agents finish
    proxy.close_episodes()

The proxy takes the run's proxy settings (`dppo.episodes.settings.ProxySettings`: the run config's `proxy` section,
whichever episode kind plays through it, a row's token budget among them) as they are, and the batch wait as an
argument. Endpoints, under each episode's base URL `http://<host>:<port>/e/<key>/v1`: `POST chat/completions`,
`POST completions`, `GET models`; the token route
`POST /e/<key>/inference/v1/generate` (vLLM's: token ids in, ids and µ out, rows joined by id prefix as completions);
the same three under one shared base URL `http://<host>:<port>/v1` (and `/inference/v1/generate`), the episode named
by the `X-Session-ID` header (its key); and
`POST /e/<key>/reward` (`{"reward": float}`) for an agent that reports its reward instead of returning it. An
unknown or ended episode gets 404 / 410; a request over `max_request_bytes` 413; more than
`max_concurrent_requests` requests in flight 429; a refused sampling parameter 400 with the OpenAI error shape
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
from dppo.episodes.proxy_replies import chat_logprobs, completion_logprobs, generate_logprobs, sse_events
from dppo.episodes.proxy_requests import RequestError, check_generate, check_request
from dppo.rollout.base import SamplingParams

MODEL_NAME = "dppo-policy"
"""The model name `GET models` lists (any name a request sends is the run's policy)."""


SESSION_HEADER = "x-session-id"
"""The header that names the episode (its key) on the shared base URL."""


def _session(request) -> str:
    key = request.headers.get(SESSION_HEADER)
    if not key:
        raise RequestError("X-Session-ID: the shared base URL needs the episode's key in this header (or use the "
                           "episode's own base URL)", "X-Session-ID", code="not_found", status=404)
    return key


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
        """`settings`: the run's `dppo.episodes.settings.ProxySettings` (a row's response tokens: its max_tokens);
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
                                   f"(port in use? set proxy.port)")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def base_url(self, episode: ProxyEpisode) -> str:
        host = self.settings.advertise_host or (
            self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1")
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

        @app.post("/e/{key}/inference/v1/generate")
        async def generate(key: str, request: Request):
            return await self._handle(key, request, "generate")

        # One base URL shared by every episode (`http://<host>:<port>/v1`): the episode is the `X-Session-ID` header
        # (its key), as clients that name their sessions send it.
        @app.post("/v1/chat/completions")
        async def shared_chat(request: Request):
            return await self._handle(_session(request), request, "chat")

        @app.post("/v1/completions")
        async def shared_completions(request: Request):
            return await self._handle(_session(request), request, "completions")

        @app.post("/inference/v1/generate")
        async def shared_generate(request: Request):
            return await self._handle(_session(request), request, "generate")

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
            raise RequestError(f"the request is larger than {cap} bytes (proxy.max_request_bytes)",
                               None, code="request_too_large", status=413)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > cap:
                raise RequestError(f"the request is larger than {cap} bytes "
                                   f"(proxy.max_request_bytes)", None, code="request_too_large",
                                   status=413)
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
            req, reply = await self._answer(ep, await self._body(request), endpoint)
            if req.stream:
                from fastapi.responses import StreamingResponse

                return StreamingResponse(iter(list(sse_events(reply, endpoint, req.include_usage))),
                                         media_type="text/event-stream")
            return reply
        except RequestError:
            ep.refused += 1
            raise
        finally:
            self._in_flight -= 1

    async def _answer(self, ep: ProxyEpisode, body: Any, endpoint: str) -> dict:
        codec = self.codec
        if codec is None or self.params is None:
            raise RequestError("the proxy is not serving (no collection running)", None, code="not_serving", status=503)
        stops = {*self.params.stop_token_ids, codec.tokenizer.eos_token_id} - {None}
        request_id, mode = "", "tokens"
        if endpoint == "generate":
            req, request_id, mode = check_generate(body, temperature=self.params.temperature,
                                                   top_k=self.params.top_k_logprobs, stop_ids=stops)
        else:
            req = check_request(body, endpoint, temperature=self.params.temperature,
                                top_k=self.params.top_k_logprobs, stop_ids=stops)
        if ep.calls >= self.settings.max_calls:
            raise RequestError(f"this episode made its {self.settings.max_calls} calls "
                               f"(proxy.max_calls)", None, code="max_calls")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = codec.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt is not None and (min(prompt) < 0 or max(prompt) >= len(codec.tokenizer)):
            raise RequestError("prompt: token ids outside the vocabulary", "prompt")
        try:
            row, extra, new = ep.place(req.messages, req.tools, prompt, codec, req.template_kwargs)
        except Exception as err:  # noqa: BLE001 - the model's chat template refused these messages (a jinja error)
            raise RequestError(f"messages: the model's chat template cannot render them: {type(err).__name__}: "
                               f"{err}", "messages") from err
        room = self.max_tokens - len(row.tokens.ids) - len(extra)
        max_new = min(req.max_tokens or self.params.max_new_tokens, self.params.max_new_tokens, room)
        if max_new < 1:
            ep.truncated += 1
            raise RequestError(f"this episode's row holds {len(row.tokens.ids) + len(extra)} response tokens, its "
                               f"budget is {self.max_tokens} (proxy.max_tokens)", "messages",
                               code="context_length_exceeded")
        row.busy = True
        context = row.tokens.context() + extra
        try:
            result = await self.batcher.submit(ep, context, max_new)
        finally:
            row.busy = False
        if ep.closed:
            raise RequestError("this episode has ended", None, code="episode_ended", status=410)
        if endpoint == "generate":
            return req, self._generated(ep, row, extra, new, req, result, context, request_id, mode)
        return req, self._reply(ep, row, extra, new, req, result, endpoint, context)

    def _generated(self, ep: ProxyEpisode, row, extra: list[int], new: bool, req, result, context: list[int],
                   request_id: str, mode: str) -> dict:
        """Record a token-route call into its row and answer it in vLLM's GenerateResponse shape."""
        tok = self.codec.tokenizer
        ep.record(row, extra, new, result, tok.eos_token_id)
        ids = result.response_ids.tolist()
        choice = {"index": 0, "finish_reason": "length" if result.finish_reason == "length" else "stop",
                  "stop_reason": None, "token_ids": ids}
        if mode == "text":
            choice["text"] = tok.decode(ids, skip_special_tokens=req.skip_special_tokens)
            choice["logprobs"] = chat_logprobs(result, tok, req.top_logprobs, False) if req.logprobs else None
        else:
            choice["logprobs"] = generate_logprobs(result, req.top_logprobs) if req.logprobs else None
        reply = {"request_id": request_id or f"gen-{ep.key}-{ep.calls}", "model": MODEL_NAME,
                 "created": int(time.time()), "output_mode": mode, "choices": [choice],
                 "usage": {"prompt_tokens": len(context), "completion_tokens": len(ids),
                           "total_tokens": len(context) + len(ids)}}
        if req.token_ids:
            reply["prompt_token_ids"] = context
        return reply

    def _reply(self, ep: ProxyEpisode, row, extra: list[int], new: bool, req, result, endpoint: str,
               context: list[int]) -> dict:
        """Record the call into its row and answer it in the endpoint's OpenAI shape (with µ's log-probs and the
        token ids when asked: `dppo.episodes.proxy_replies`)."""
        tok = self.codec.tokenizer
        ep.record(row, extra, new, result, tok.eos_token_id)
        ids = result.response_ids.tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        shown = text if req.skip_special_tokens else tok.decode(ids, skip_special_tokens=False)
        usage = {"prompt_tokens": len(context), "completion_tokens": len(ids), "total_tokens": len(context) + len(ids)}
        ident = f"{ep.key}-{ep.calls}"
        logprobs = chat_logprobs if endpoint == "chat" else completion_logprobs
        choice = {"index": 0, "logprobs": logprobs(result, tok, req.top_logprobs, req.tokens_as_ids)
                  if req.logprobs else None}
        if req.token_ids:
            choice["token_ids"] = ids
        if endpoint == "completions":
            if req.token_ids:
                choice["prompt_token_ids"] = context
            finish = "length" if result.finish_reason == "length" else "stop"
            return {"id": f"cmpl-{ident}", "object": "text_completion", "created": int(time.time()),
                    "model": MODEL_NAME, "usage": usage, "choices": [{**choice, "text": shown, "finish_reason": finish}]}
        message, kind = reply_message(text, ep.tool_calls)
        ep.tool_calls += len(message.get("tool_calls") or [])
        row.remember(req.messages, text, message, new=new)
        if shown != text and "tool_calls" not in message:
            message = {**message, "content": shown}
        finish = "length" if result.finish_reason == "length" else kind
        reply = {"id": f"chatcmpl-{ident}", "object": "chat.completion", "created": int(time.time()),
                 "model": MODEL_NAME, "usage": usage,
                 "choices": [{**choice, "message": message, "finish_reason": finish}]}
        if req.token_ids:
            reply["prompt_token_ids"] = context
        return reply


__all__ = ["MODEL_NAME", "SESSION_HEADER", "Proxy", "is_loopback"]
