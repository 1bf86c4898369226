"""OpenEnv environments as dppo environments: `make_environment("openenv", base_url=...)` or `app="module:app"`.

OpenEnv (the `openenv` package) serves a Gym-style environment over a WebSocket: `reset(**kwargs)` and
`step(action)` each answer an observation with a reward and a `done` flag. This adapter is a dppo `Environment`
over OpenEnv's own client (`GenericEnvClient`, one per episode, one server session each):

    reset(example)  -> client.reset(**reset_args, **fields of the example named by reset_keys)
                       -> [system: system_prompt (+ the action's JSON schema), user: the observation's text]
    step(reply)     -> the reply parsed as the action (a JSON object checked against the server's action schema,
                       or the reply's text as one field, action_key) -> client.step(action)
                       -> EnvStep(user: the next observation's text, reward, done)
    close()         -> the client's WebSocket closed (the episode runner calls it when the episode ends)

The server is either `base_url` (one already running) or `app`, the "module:app" / "path/to/file.py:app" of an
OpenEnv server app (`openenv.core.env_server.create_app(...)`) that dppo serves itself with uvicorn on a free
loopback port, in a daemon thread, started once per process and shared by every episode (and every factory) that
names the same app. Either is reached (its `/schema` read) when the first instance is built, so an unreachable
server or an app that does not start fails `make_environment` naming the option, before any model loads.

Rewards: "sum" makes each turn's reward the step's reward (the episode's reward is their sum); "last" makes each
turn's reward the change in the step's reward, so the episode's reward (the sum) is the last reward the server gave,
also when the episode is cut by env.max_turns. A reward of None counts as 0.

Failures: a reply that is not a valid action (no JSON object, an unknown or missing field, a value of the wrong
type, or one the server's validation refuses) gets an error observation naming what is wrong and the episode goes on
(counted in `episode/tool_errors_mean`); the server is not called. A server that dies mid-episode, an environment
that raises in the server, or a message unanswered within timeout_s raises from `step`, which the episode runner
contains: that episode ends with the rewards earned so far, counted in `episode/env_errors` (or `env_timeouts`).

Why an adapter of dppo's own rather than verifiers' OpenEnv taskset: verifiers 0.4.0 has one
(`verifiers.v1.tasksets.openenv`), but its tasks are a fixed list of reset arguments in its config rather than the
run's task examples; it starts environments through OpenEnv's `from_env` (a Hugging Face Space cloned by UV, or a
Docker image: neither works offline) unless given a `base_url` of a server already running; it sends the whole
observation and the action schema as JSON every turn; a reply that is not an action raises (the run, not an error
observation); and its episodes go through verifiers' harness and client to dppo's proxy. This adapter runs in dppo's
own episode loop (`dppo.episodes.env_loop`), where dppo owns the token ids: the environment sees and returns text,
the ids trained are the ids sampled, never re-tokenised, with µ and µ's top-K on every generated token.

Needs `openenv` (tested with 0.4.1; `pip install --no-deps openenv==0.4.1` beside fastapi, uvicorn, websockets,
pydantic and requests) and, for `app`, uvicorn. The server's `max_concurrent_envs` must admit a step's episodes at once
(rollout.prompts_per_step x rollout.group_size): a session refused at capacity fails its reset, which stops the step.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from dppo.envs.base import EnvStep, Environment
from dppo.example import Example, Message
from dppo.runtime.plugins import load_object

REWARDS = ("sum", "last")
EXAMPLE_FIELDS = ("prompt", "answer", "metadata", "uid")
"""The fields of an example that reset_keys may name; any other name is a key of `example.metadata`."""
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                             "boolean": (bool,), "array": (list,), "object": (dict,)}


@dataclass(frozen=True)
class Server:
    """An OpenEnv server reached once: its HTTP URL and its action and observation JSON schemas (from /schema)."""

    url: str
    action_schema: dict
    observation_schema: dict
    stop: Any = None
    """Stops the server dppo serves (an `app`); None for a base_url."""


_SERVERS: dict[tuple[str, str], Server] = {}
_SERVERS_LOCK = threading.Lock()


class OpenEnvEnv(Environment):
    """An OpenEnv environment, one server session per episode (see the module docstring)."""

    def __init__(self, *, base_url: str = "", app: str = "", system_prompt: str = "", reward: str = "sum",
                 reset_keys: list[str] | dict[str, str] | None = None, reset_args: dict[str, Any] | None = None,
                 observation_key: str = "", action_key: str = "", show_schema: bool = True, timeout_s: float = 30.0,
                 startup_timeout_s: float = 30.0) -> None:
        """base_url: a running OpenEnv server (http:// or ws://). app: "module:app" or "path/to/file.py:app" of an
        OpenEnv server app that dppo serves itself (exactly one of the two). system_prompt: the system message.
        reward: "sum" of the steps' rewards, or the "last" one. reset_keys: example fields passed to reset, a list
        (["answer", "uid"]) or a map of reset argument -> field ({"target": "answer"}); a name other than prompt,
        answer, metadata, uid is a key of the example's metadata. reset_args: fixed reset arguments ({"seed": 0}).
        observation_key: the observation field that becomes the message text ("" = the only field, else all of
        them as JSON). action_key: the action field that the reply's text fills ("" = the reply is the action as a
        JSON object). show_schema: the action's JSON schema in the system message (JSON actions). timeout_s: the
        client's connect and per-message timeout. startup_timeout_s: how long the server may take to answer first."""
        if reward not in REWARDS:
            raise ValueError(f"reward: expected one of {list(REWARDS)}, got {reward!r}")
        if bool(base_url) == bool(app):
            raise ValueError("base_url / app: name exactly one: the URL of a running OpenEnv server (base_url) or "
                             "the 'module:app' of an OpenEnv server app that dppo serves (app)")
        if base_url and not re.match(r"^(https?|wss?)://", base_url):
            raise ValueError(f"base_url: expected an http://, https://, ws:// or wss:// URL, got {base_url!r}")
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")
        if reset_args is not None and not isinstance(reset_args, dict):
            raise ValueError(f"reset_args: expected a JSON object of reset arguments, got {reset_args!r}")
        for name, value in (("system_prompt", system_prompt), ("observation_key", observation_key),
                            ("action_key", action_key)):
            if not isinstance(value, str):
                raise ValueError(f"{name}: expected a string, got {value!r}")
        if not isinstance(show_schema, bool):
            raise ValueError(f"show_schema: expected true or false, got {show_schema!r}")
        self.reset_keys = _reset_keys(reset_keys)
        self.reset_args = dict(reset_args or {})
        self.system_prompt, self.reward, self.observation_key, self.action_key = (system_prompt, reward,
                                                                                  observation_key, action_key)
        self.show_schema, self.timeout_s = show_schema, float(timeout_s)
        if importlib.util.find_spec("openenv") is None:
            raise ValueError("the openenv environment needs the openenv package (not installed): "
                             "pip install --no-deps openenv==0.4.1")
        self.server = serve(app, startup_timeout_s) if app else reach(base_url, startup_timeout_s)
        _check_field("action_key", action_key, self.server.action_schema, "action")
        _check_field("observation_key", observation_key, self.server.observation_schema, "observation")
        self._client = None
        self._last_reward = 0.0

    # --- the episode ------------------------------------------------------------------------------------------

    def reset(self, example: Example) -> list[Message]:
        from openenv.core import GenericEnvClient

        self.example = example
        kwargs = {**self.reset_args, **{arg: _field(example, name) for arg, name in self.reset_keys.items()}}
        self._end_session()  # (a second reset of one instance opens a fresh session)
        self._client = GenericEnvClient(base_url=self.server.url, connect_timeout_s=self.timeout_s,
                                        message_timeout_s=self.timeout_s).sync()
        result = self._client.reset(**kwargs)
        self._last_reward = 0.0
        text = self._observation_text(result.observation) or _question(example)
        system = self._system_text()
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]

    def step(self, reply: str) -> EnvStep:
        if self._client is None:
            raise RuntimeError("step() before reset(): no OpenEnv session")
        action, why = self._action(reply)
        if why is None:
            try:
                result = self._client.step(action)
            except RuntimeError as err:  # the server answered an error; its validation's leaves the session open
                if "(code: VALIDATION_ERROR)" not in str(err):
                    raise
                why = f"the environment refused the action {json.dumps(action)[:200]} ({err})"
        if why is not None:
            return EnvStep(messages=({"role": "user", "content": self._error_text(why)},), info={"tool_errors": 1.0})
        reward = float(result.reward or 0.0)
        if self.reward == "last":
            reward, self._last_reward = reward - self._last_reward, reward
        if result.done:
            return EnvStep(reward=reward, done=True)
        return EnvStep(messages=({"role": "user", "content": self._observation_text(result.observation)},),
                       reward=reward)

    def close(self) -> None:
        """Closes the episode's session (its WebSocket and the client's event-loop thread)."""
        self._end_session()

    def _end_session(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:  # OpenEnv 0.4.1's server logs an exception for each client that closes its socket before the server does
            client._run(_server_closes(client.async_client, min(self.timeout_s, 5.0)))
        except Exception:  # noqa: BLE001 - a server already gone: nothing to wait for
            pass
        client.close()

    # --- text <-> OpenEnv ---------------------------------------------------------------------------------------

    def _system_text(self) -> str:
        parts = [self.system_prompt] if self.system_prompt else []
        if self.show_schema and not self.action_key:
            parts.append("Reply with one JSON object, the action, matching this JSON schema: "
                         + json.dumps(_shown_schema(self.server.action_schema)))
        return "\n\n".join(parts)

    def _observation_text(self, observation: dict) -> str:
        fields = {k: v for k, v in (observation or {}).items() if k != "metadata"}
        if self.observation_key:
            value = fields.get(self.observation_key, fields)
        else:
            value = next(iter(fields.values())) if len(fields) == 1 else fields
        return value if isinstance(value, str) else json.dumps(value)

    def _error_text(self, why: str) -> str:
        if self.action_key:
            return f"Error: {why}."
        return f"Error: {why}. Reply with one JSON object, the action, matching the action's JSON schema."

    def _action(self, reply: str) -> tuple[dict | None, str | None]:
        """The reply as an action, or None and why it is not one."""
        if self.action_key:
            return {self.action_key: reply.strip()}, None
        action = _json_object(reply)
        if action is None:
            return None, "the reply holds no JSON object"
        why = _schema_error(action, self.server.action_schema)
        return (None, why) if why else (action, None)


# --- the server: reached (base_url) or served (app), once per process ----------------------------------------------


def reach(base_url: str, startup_timeout_s: float) -> Server:
    """The server at base_url, its schemas read (retried until startup_timeout_s); ValueError naming base_url."""
    url = re.sub(r"^ws", "http", base_url.rstrip("/"))
    with _SERVERS_LOCK:
        if ("url", url) not in _SERVERS:
            try:
                schemas = _schemas(url, startup_timeout_s)
            except OSError as err:
                raise ValueError(f"base_url: no OpenEnv server answers at {base_url} (GET /schema within "
                                 f"startup_timeout_s {startup_timeout_s:g}s): {err}") from None
            _SERVERS["url", url] = Server(url, *schemas)
        return _SERVERS["url", url]


def serve(app: str, startup_timeout_s: float) -> Server:
    """The OpenEnv server app `app` served on a free loopback port (once per process); ValueError naming app."""
    with _SERVERS_LOCK:
        if ("app", app) not in _SERVERS:
            _SERVERS["app", app] = _start(app, startup_timeout_s)
        return _SERVERS["app", app]


def _start(app: str, startup_timeout_s: float) -> Server:
    try:
        import uvicorn
    except ImportError:
        raise ValueError("app: serving an OpenEnv app needs uvicorn (not installed): pip install 'dppo[agents]'") \
            from None
    try:
        asgi, _ = load_object(app, kind="OpenEnv app")
    except ValueError as err:
        raise ValueError(f"app: {err}") from None
    if not callable(asgi):
        raise ValueError(f"app: {app!r} is {type(asgi).__name__}, not an ASGI app (e.g. openenv's create_app(...))")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(asgi, log_config=None, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1))
    def run() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit:  # (uvicorn exits when the app's startup fails; its error is logged)
            pass

    thread = threading.Thread(target=run, name="dppo-openenv-app", daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            stop()
            why = "it stopped during startup" if not thread.is_alive() else \
                f"it did not start within startup_timeout_s {startup_timeout_s:g}s"
            raise ValueError(f"app: the OpenEnv app {app!r} could not be served: {why} (its error is logged above)")
        time.sleep(0.02)
    try:
        schemas = _schemas(url, max(deadline - time.monotonic(), 1.0))
    except OSError as err:
        stop()
        raise ValueError(f"app: {app!r} started but answers no OpenEnv /schema: {err}") from None
    atexit.register(stop)
    return Server(url, *schemas, stop=stop)


async def _server_closes(client, timeout_s: float) -> None:
    """Sends OpenEnv's close message and waits for the server to close the socket (it does once the session is gone)."""
    import asyncio

    ws = getattr(client, "_ws", None)  # (the client's socket: GenericEnvClient sends the close and closes at once)
    if ws is None:
        return
    await ws.send(json.dumps({"type": "close"}))
    try:
        await asyncio.wait_for(ws.recv(), timeout_s)  # ends with ConnectionClosed once the server has closed
    except Exception:  # noqa: BLE001 - closed (the expected end) or not within timeout_s: the client closes it
        pass


def _schemas(url: str, timeout_s: float) -> tuple[dict, dict]:
    """The server's action and observation schemas (GET /schema), retried until timeout_s; OSError past it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/schema", timeout=max(deadline - time.monotonic(), 0.1)) as answer:
                body = json.loads(answer.read())
            return body["action"], body["observation"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            if time.monotonic() >= deadline:
                raise OSError(f"{type(err).__name__}: {err}") from None
            time.sleep(0.1)


# --- small pure helpers ------------------------------------------------------------------------------------------


def _reset_keys(keys) -> dict[str, str]:
    """reset_keys as a map of reset argument -> example field."""
    if keys is None:
        return {}
    if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
        return {k: k for k in keys}
    if isinstance(keys, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        return dict(keys)
    raise ValueError(f"reset_keys: expected a list of example fields or a map of reset argument -> field, got {keys!r}")


def _field(example: Example, name: str) -> Any:
    """An example's field (prompt as a list of messages) or, for any other name, its metadata's key."""
    if name == "prompt":
        return example.prompt if isinstance(example.prompt, str) else [dict(m) for m in example.prompt]
    if name in EXAMPLE_FIELDS:
        return getattr(example, name)
    metadata = example.metadata if isinstance(example.metadata, dict) else {}
    if name not in metadata:
        raise ValueError(f"reset_keys: example {example.uid} has no field or metadata key {name!r} (fields: "
                         f"{list(EXAMPLE_FIELDS)}; metadata keys: {sorted(metadata)})")
    return metadata[name]


def _question(example: Example) -> str:
    prompt = example.prompt
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def _check_field(option: str, key: str, schema: dict, what: str) -> None:
    fields = [k for k in schema.get("properties", {}) if k != "metadata"]
    if key and key not in fields:
        raise ValueError(f"{option}: the server's {what} has no field {key!r}; its fields: {fields}")


def _shown_schema(schema: dict) -> dict:
    """The action's schema as the model is shown it: its fields without OpenEnv's `metadata`, titles dropped."""
    props = {k: {a: b for a, b in v.items() if a != "title"} for k, v in schema.get("properties", {}).items()
             if k != "metadata"}
    shown: dict[str, Any] = {"type": "object", "properties": props}
    if schema.get("required"):
        shown["required"] = [k for k in schema["required"] if k != "metadata"]
    return shown


def _json_object(reply: str) -> dict | None:
    """The JSON object a reply holds: the whole reply, a fenced block, or its outermost {...}; None if none.

    >>> _json_object('Sure: ```json\\n{"guess": "4"}\\n```')
    {'guess': '4'}
    """
    text = reply.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    candidates = [text] + ([fenced.group(1)] if fenced else [])
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{"):text.rindex("}") + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _schema_error(action: dict, schema: dict) -> str | None:
    """What is wrong with `action` against the action schema's fields (unknown, missing, a plain type), or None.
    Anything finer (ranges, patterns, unions) is left to the server's validation.

    >>> _schema_error({"n": [1]}, {"properties": {"n": {"type": "integer"}}, "required": ["n"]})
    "field 'n': expected integer, got [1]"
    """
    props = schema.get("properties", {})
    unknown = sorted(set(action) - set(props))
    if unknown and schema.get("additionalProperties", True) is False:  # (OpenEnv's Action forbids extra fields)
        return f"unknown field(s) {unknown}; the action's fields: {[k for k in props if k != 'metadata']}"
    missing = [k for k in schema.get("required", []) if k not in action]
    if missing:
        return f"missing field(s) {missing}"
    for key, value in action.items():
        kind = props.get(key, {}).get("type")
        if isinstance(kind, str) and kind in _JSON_TYPES:
            a_bool_as_number = isinstance(value, bool) and kind in ("integer", "number")
            if not isinstance(value, _JSON_TYPES[kind]) or a_bool_as_number:
                return f"field {key!r}: expected {kind}, got {json.dumps(value)[:100]}"
    return None


__all__ = ["OpenEnvEnv", "REWARDS", "Server", "reach", "serve"]
