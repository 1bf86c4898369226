"""The recording proxy: an OpenAI-compatible HTTP endpoint in front of a dppo engine, which records every call.

    proxy = Proxy(spec.settings()); proxy.start()                  # uvicorn in a background thread (FastAPI app)
    ep = proxy.open(prompt_index, example)                         # an episode; its base URL: proxy.base_url(ep)
    ... agents call /e/<episode key>/v1/chat/completions ...       # (run on proxy.loop)
    proxy.serve(engine, params, busy=lambda: ...)                  # THIS thread runs the engine until agents finish
    proxy.close_episodes()

Endpoints, under each episode's base URL `http://<host>:<port>/e/<key>/v1`: `POST chat/completions`,
`POST completions`, `GET models`; and `POST /e/<key>/reward` (`{"reward": float}`) for an agent that reports its
reward instead of returning it. An unknown or ended episode gets 404 / 410; a request over `max_request_bytes` 413;
more than `max_concurrent` requests in flight 429; a refused sampling parameter 400 with the OpenAI error shape
(`dppo.agents.chat`). When the proxy binds to anything but the loopback interface, every request needs
`Authorization: Bearer <the run's key>` (401 otherwise); on localhost the episode's random key in its URL is the
credential.

**Batching.** Requests are not answered one by one: the thread that called `serve` (the one that owns the
engine) takes every request waiting once all running episodes have one in flight, or `batch_wait_s` after the
last one arrived, and answers them with one `engine.generate` call per distinct max_new_tokens — so P x G agents
running concurrently cost what P x G environment episodes cost. Each call's generated ids, µ and µ's top-K cells
and per-token weight versions are recorded into its episode's rows (`dppo.agents.rows`).
"""

import asyncio
import copy
import dataclasses
import ipaddress
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from dppo.agents.chat import RequestError, check_request, reply_message, template_messages
from dppo.agents.rows import AgentEpisode
from dppo.rollout.base import SamplingParams
from dppo.rollout.episodes import turn_seed


@dataclass(frozen=True)
class ProxySettings:
    """What the proxy enforces (from the run config's `AgentConfig` through `AgentSpec.settings`, which owns the
    defaults), and how long it waits to fill a batch."""

    host: str
    port: int
    """0: a free port."""
    max_calls: int
    """Calls per episode; past it a call is refused (code max_calls)."""
    max_tokens: int
    """Response tokens of one row (generated and inserted), as env.max_tokens for episodes."""
    max_request_bytes: int
    max_concurrent: int
    batch_wait_s: float = 0.2
    """Longest wait, after the last call arrived, for the other running episodes' calls before a batch is taken."""
    model_name: str = "dppo-policy"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _Call:
    episode: AgentEpisode
    context: list[int]
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Proxy:
    """See the module docstring. State: the episodes of the current collection and the waiting calls."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.key = secrets.token_urlsafe(24)
        """The run's key (needed in `Authorization` when the proxy is exposed beyond localhost)."""
        self.episodes: dict[str, AgentEpisode] = {}
        self.tokenizer = None
        self._source = None
        self.params: SamplingParams | None = None
        self._pending: list[_Call] = []
        self._cond = threading.Condition()
        self._last_arrival = 0.0
        self._in_flight = 0
        self.batch_sizes: list[int] = []
        """Calls per engine call, every engine call of the proxy's life (benchmarks and tests read it)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

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

    def base_url(self, episode: AgentEpisode) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}/e/{episode.key}/v1"

    def open(self, prompt_index: int, example) -> AgentEpisode:
        ep = AgentEpisode(prompt_index, example, secrets.token_urlsafe(12), order=len(self.episodes))
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
            self.tokenizer, self._source = copy.deepcopy(engine.tokenizer), engine.tokenizer
        self.params = params

    def serve(self, engine, params: SamplingParams, *, active: Callable[[], int], finished: Callable[[], bool],
              prefix_tokens: int = 0) -> None:
        """Answer calls with `engine` until `finished()` (every episode ended) and no call waits. A batch is taken
        when `active()` (episodes running) calls wait, or `batch_wait_s` after the last arrival; its calls go to
        the engine in the episodes' order (so a batch is the one an environment's episodes would make). The engine's
        prefix cache (the hf engine's; `prefix_tokens` positions) is on meanwhile: a call that extends an earlier
        one prefills only its new tokens."""
        engine.enable_prefix_cache(prefix_tokens)
        try:
            self._serve(engine, params, active, finished)
        finally:
            engine.enable_prefix_cache(0)
            self.params = None

    def _serve(self, engine, params: SamplingParams, active, finished) -> None:
        wait = self.settings.batch_wait_s
        batch = 0
        while True:
            with self._cond:
                while not self._pending and not finished():
                    self._cond.wait(0.05)
                if not self._pending:
                    return
                while len(self._pending) < active() and time.monotonic() < self._last_arrival + wait:
                    self._cond.wait(max(self._last_arrival + wait - time.monotonic(), 0.001))
                calls, self._pending = self._pending, []
            calls = sorted((c for c in calls if not self._dropped(c)), key=lambda c: c.episode.order)
            if not calls:
                continue
            if batch > 0 and engine.between_chunks is not None:  # in-flight updates: newer weights between calls
                engine.between_chunks()
            for max_new in sorted({c.max_new for c in calls}):
                group = [c for c in calls if c.max_new == max_new]
                call_params = dataclasses.replace(params, n=1, max_new_tokens=max_new, seed=turn_seed(params.seed, batch))
                self._generate(engine, group, call_params)
                self.batch_sizes.append(len(group))
                batch += 1

    def wake(self) -> None:
        """An episode ended: the serving thread re-checks whether the batch is complete."""
        with self._cond:
            self._cond.notify_all()

    def _dropped(self, call: _Call) -> bool:
        if call.episode.closed:
            call.loop.call_soon_threadsafe(_set, call.future, None, RequestError(
                "this episode has ended", None, code="episode_ended", status=410))
            return True
        return False

    def _generate(self, engine, group: list[_Call], params: SamplingParams) -> None:
        try:
            results = engine.generate([c.context for c in group], params)
        except ValueError:
            if len(group) == 1:  # one bad call (its context too long for the engine): only it fails
                results = None
            else:
                for c in group:
                    self._generate(engine, [c], params)
                return
        except Exception as err:  # noqa: BLE001 - an engine failure: every call of the batch gets it, then raise
            for c in group:
                c.loop.call_soon_threadsafe(_set, c.future, None, RequestError(
                    f"the engine failed: {type(err).__name__}: {err}", None, code="engine_error", status=500))
            raise
        if results is None:
            group[0].loop.call_soon_threadsafe(_set, group[0].future, None, RequestError(
                f"the prompt ({len(group[0].context)} tokens) does not fit the engine's context", "messages",
                code="context_length_exceeded"))
            return
        for c, r in zip(group, results):
            c.loop.call_soon_threadsafe(_set, c.future, r, None)

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
            return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model",
                                                "created": 0, "owned_by": "dppo"}]}

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

    def _episode(self, key: str, request) -> AgentEpisode:
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
        if self._in_flight >= self.settings.max_concurrent:
            raise RequestError(f"more than {self.settings.max_concurrent} requests in flight", None,
                               code="rate_limit_exceeded", status=429)
        self._in_flight += 1
        try:
            return await self._answer(ep, await self._body(request), endpoint)
        except RequestError:
            ep.refused += 1
            raise
        finally:
            self._in_flight -= 1

    async def _answer(self, ep: AgentEpisode, body: Any, endpoint: str) -> dict:
        s, tok = self.settings, self.tokenizer
        if tok is None or self.params is None:
            raise RequestError("the proxy is not serving (no collection running)", None, code="not_serving", status=503)
        req = check_request(body, endpoint, temperature=self.params.temperature)
        if ep.calls >= s.max_calls:
            raise RequestError(f"this episode made its {s.max_calls} calls (agent.max_calls)", None, code="max_calls")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = tok.encode(prompt, add_special_tokens=False)
        elif prompt is not None and (min(prompt) < 0 or max(prompt) >= len(tok)):
            raise RequestError("prompt: token ids outside the vocabulary", "prompt")
        try:
            row, extra, new = ep.place(req.messages, req.tools, prompt, tok)
        except Exception as err:  # noqa: BLE001 - the model's chat template refused these messages (a jinja error)
            raise RequestError(f"messages: the model's chat template cannot render them: {type(err).__name__}: "
                               f"{err}", "messages") from err
        room = s.max_tokens - len(row.ids) - len(extra)
        max_new = min(req.max_tokens or self.params.max_new_tokens, self.params.max_new_tokens, room)
        if max_new < 1:
            ep.truncated += 1
            raise RequestError(f"this episode's row holds {len(row.ids) + len(extra)} response tokens, its budget is "
                               f"{s.max_tokens} (env.max_tokens)", "messages", code="context_length_exceeded")
        row.busy = True
        try:
            result = await self._submit(ep, row.context() + extra, max_new)
        finally:
            row.busy = False
        if ep.closed:
            raise RequestError("this episode has ended", None, code="episode_ended", status=410)
        return self._record(ep, row, extra, new, req, result, endpoint)

    async def _submit(self, ep: AgentEpisode, context: list[int], max_new: int):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._pending.append(_Call(ep, context, max_new, future, loop))
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        return await future

    def _record(self, ep: AgentEpisode, row, extra: list[int], new: bool, req, result, endpoint: str) -> dict:
        tok = self.tokenizer
        if extra:
            row.add_env(extra, max(ep.calls - 1, 0))  # (the turn it answers)
        row.add_generated(result, ep.calls)
        ids = result.response_ids.tolist()
        row.stopped = bool(ids) and ids[-1] == tok.eos_token_id
        text = tok.decode(ids, skip_special_tokens=True)
        ep.calls += 1
        if new:
            ep.rows.append(row)
        usage = {"prompt_tokens": len(row.context()) - len(ids), "completion_tokens": len(ids),
                 "total_tokens": len(row.context())}
        ident = f"{ep.key}-{ep.calls}"
        if endpoint == "completions":
            return {"id": f"cmpl-{ident}", "object": "text_completion", "created": int(time.time()),
                    "model": self.settings.model_name, "usage": usage,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": "length" if result.finish_reason == "length" else "stop"}]}
        message, kind = reply_message(text, ep.tool_calls)
        calls = message.get("tool_calls") or []
        ep.tool_calls += len(calls)
        if not new:
            k = len(row.messages)
            row.raw = row.raw + [{"role": "assistant", "content": row.returned["raw"]}] + \
                template_messages(req.messages[k + 1:])
        row.messages = req.messages
        row.returned = {"role": "assistant", "content": message["content"] or "", "raw": text,
                        "tool_calls": [{"id": c["id"], "name": c["function"]["name"],
                                        "arguments": json.loads(c["function"]["arguments"])} for c in calls]}
        finish = "length" if result.finish_reason == "length" else kind
        return {"id": f"chatcmpl-{ident}", "object": "chat.completion", "created": int(time.time()),
                "model": self.settings.model_name, "usage": usage,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]}


def _set(future: asyncio.Future, value, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


__all__ = ["Proxy", "ProxySettings", "is_loopback"]
