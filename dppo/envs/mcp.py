"""MCP tools as a dppo tool environment ("mcp"): the tools of an MCP server, stdio or streamable HTTP, are the tools
the model may call, and the episodes are those of every `ToolEnv` (docs/agents.md, "MCP tools").

    factory = make_environment("mcp", command=["python", "server.py"], tools=["add"], reward="last_number")
    env = factory()        # a fresh MCPEnv per episode; all of them call the factory's one server session
    factory.close()        # (also done at exit)

- **One session, connected before any model loads.** `MCPEnv.factory(**options)` (which `make_environment` calls)
  launches the stdio server or reaches the URL, runs the MCP handshake and `tools/list`, so a bad option, an
  unreachable server or a failed handshake fails there, a ValueError naming the option. The client session lives on
  an asyncio loop in a daemon thread that the session owns; episodes' tool calls (from the episode runner's threads)
  are submitted to it, so the calls of concurrent episodes are in flight together. The factories of one process that
  name the same server (command, url, env, cwd) share its session: a run's start-up check and its collector each
  build a factory, and the server is launched once. A session whose server died is not shared again: the next
  factory connects anew.
- **A stdio command's `python` is the run's.** A bare `python` / `python3` first (`["python", "server.py"]`) runs
  as `sys.executable` (`resolve_command`), where `mcp` is installed, not as the first python on PATH. Errors about a
  server name it (its command or URL) and quote the last lines of a stdio server's stderr, which is otherwise copied
  to this process's stderr as it comes.
- **`tools/list` → the tools offered**, each a callable carrying the server's JSON schema unchanged (its
  `tool_schema` attribute, which `dppo.envs.tools.tool_schema` passes through to the prompt); `tools` (an allow-list)
  narrows them. **`tools/call` → tool messages**, through `ToolEnv.step`: the output cap, the timeout and the error
  handling are those of every dppo tool. A result flagged `isError`, a call past `tool_timeout_s` (cancelled on the
  server), a server that died: each is an error tool message counted in the step's info, never a crash.
- **The final answer** (a reply without tool calls) is scored by `reward`: a dppo reward (a name of
  `dppo.rewards.REWARDS` or an import path; called with the answer and the example), or ``"tool:NAME"``: the server's
  tool NAME, called with ``{"answer": <the reply>, "gold": <the example's answer>}``, whose text is the reward (that
  tool is not offered to the model). A failing reward tool ends the episode as an environment error (counted).
- A tool message is the result's text blocks joined by newlines; other blocks are named (``[image image/png]``,
  ``[resource file:///x]``); a result with structured content and no text is shown as JSON.

The `mcp` package (2.x) is imported when a factory is built, not with `dppo.envs`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import json
import os
import shlex
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dppo.envs.base import ToolEnv
from dppo.example import Example, Message
from dppo.rewards.registry import get_reward

DEFAULT_SYSTEM = "You are a helpful assistant. Use the tools when they help, then reply with the final answer."
REWARD_TOOL = "tool:"
"""The prefix of a `reward` that names a tool of the server."""
CANCEL_AFTER_S = 1.0
"""A call still running this long after its tool_timeout_s is cancelled on the server (ToolEnv answered it already)."""
_MAX_PAGES = 100  # tools/list pages read at most (a paginator that never ends cannot hang the start)
PYTHONS = ("python", "python3")
"""A stdio command's first word that means "the run's own interpreter" (`sys.executable`, `resolve_command`)."""
STDERR_LINES = 5
"""The last lines of a stdio server's stderr that an error about it quotes."""


class MCPToolError(RuntimeError):
    """A tool's result flagged isError, or a server that cannot answer (its message is what the model sees)."""


class MCPSession:
    """One client session to an MCP server, run on an asyncio loop in a daemon thread that this object owns.

    Connected on construction (the handshake and `tools/list` within `connect_timeout_s`, else ValueError); `call`
    may be called from any thread but the loop's; `close` ends the session (and a stdio server's process).
    """

    def __init__(self, server: Any, *, option: str, connect_timeout_s: float, name: str = "",
                 stderr: "_StderrTail | None" = None) -> None:
        from mcp import Client  # (optional, heavy: imported when a session is built)

        self.name, self.stderr = name, stderr  # (the server, for error messages: its command or URL; its stderr)
        try:
            client = Client(server)
        except Exception as err:  # noqa: BLE001 - what the client refuses, named
            self._detach()
            raise ValueError(f"{option}: {_describe(err)}{self.said()}") from None
        self.pid, self.error = os.getpid(), None
        self._client, self._ended = None, threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dppo-mcp", daemon=True)
        self._thread.start()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(client, ready), self._loop)
        try:
            self.tools = ready.result(timeout=connect_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            self._detach()
            raise ValueError(f"{option}: no MCP handshake and tools/list within connect_timeout_s="
                             f"{connect_timeout_s:g}s{self.said()}") from None
        except Exception as err:  # noqa: BLE001 - whatever the transport or the handshake raised, named
            self.close()
            self._detach()
            raise ValueError(f"{option}: cannot connect to the MCP server: {_describe(err)}"
                             f"{self.said(wait_s=1.0)}") from None
        self._detach()  # (the server runs: only its own end of the stderr pipe is left open)

    def _detach(self) -> None:
        if self.stderr is not None:
            self.stderr.detach()

    def said(self, wait_s: float = 0.0) -> str:
        """` [server: <its command or URL>; its stderr ended: <last lines>]` for an error message about the server
        (the stderr read until it ends, at most `wait_s`: a process that exited has written it all)."""
        if not self.name:
            return ""
        tail = self.stderr.tail(wait_s) if self.stderr is not None else ""
        return f" [server: {self.name}" + (f"; its stderr ended: {tail}" if tail else "") + "]"

    async def _serve(self, client, ready: concurrent.futures.Future) -> None:
        """Enter the client (the handshake), list the tools, then hold the session open until cancelled."""
        try:
            async with client:
                tools, cursor = [], None
                for _ in range(_MAX_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    if (cursor := page.next_cursor) is None:
                        break
                self._client = client
                ready.set_result(tools)
                await asyncio.Event().wait()  # until close() cancels this task (or the transport fails)
        except BaseException as err:  # noqa: BLE001 - recorded: calls then answer that the server is gone
            if self.error is None and not isinstance(err, asyncio.CancelledError):  # (close() cancels)
                self.error = err
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else ConnectionError(repr(err)))
        finally:
            self._client = None
            self._ended.set()

    @property
    def alive(self) -> bool:
        """Connected, in this process (a forked child has no loop thread), and not closed or failed."""
        return (self.pid == os.getpid() and self._client is not None and self.error is None
                and not self._ended.is_set())

    def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        """tools/call `name`: the result as text; MCPToolError for an error result or a server that cannot answer,
        TimeoutError past `timeout_s` (the request is then cancelled)."""
        client = self._client
        if client is None or not self.alive:
            raise MCPToolError(f"the MCP server is gone ({_describe(self.error) if self.error else 'closed'})"
                               f"{self.said()}")
        future = asyncio.run_coroutine_threadsafe(client.call_tool(name, arguments), self._loop)
        try:
            result = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"tool {name} timed out after {timeout_s:g}s") from None
        except Exception as err:  # noqa: BLE001 - a transport or protocol failure is the tool's answer
            closed = _closed(err)
            if closed:  # the server is gone: this session is not shared again, its later calls fail at once
                self.error = err
                self._main.cancel()
            raise MCPToolError(f"the MCP server did not answer: {_describe(err)}"
                               f"{self.said(wait_s=0.5 if closed else 0.0)}") from None
        text = result_text(result)
        if result.is_error:
            raise MCPToolError(text)
        return text

    def close(self, timeout_s: float = 5.0) -> None:
        """End the session (a stdio server's process with it) and the loop thread; idempotent."""
        if self.pid != os.getpid() or not self._thread.is_alive():
            return
        self._main.cancel()
        self._ended.wait(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)


def result_text(result) -> str:
    """The text of a CallToolResult: its text blocks joined by newlines, other blocks named; structured content as
    JSON when there is no text."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            parts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:  # image, audio, and whatever later versions add
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, default=str)
    return "\n".join(parts)


def _closed(err: BaseException) -> bool:
    """Whether `err` says the connection is gone (the server died or closed it), not that one request failed."""
    import anyio
    from mcp_types import CONNECTION_CLOSED

    if isinstance(err, BaseExceptionGroup):
        return any(_closed(e) for e in err.exceptions)
    return (getattr(err, "code", None) == CONNECTION_CLOSED
            or isinstance(err, (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError)))


def _describe(err: BaseException) -> str:
    """`Type: message` of the innermost errors of an exception (group), which anyio's task groups wrap."""
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in err.exceptions)
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def resolve_command(argv: Sequence[str]) -> list[str]:
    """A stdio server's command as it is run: a bare `python` or `python3` first (no path) becomes `sys.executable`,
    the run's own interpreter, where dppo and its `mcp` are installed (the first `python` on PATH may be another one,
    without `mcp`: its server dies at once and the run fails with "Connection closed"). A path (`/usr/bin/python3`,
    `.venv/bin/python`) or any other program is run as given."""
    argv = list(argv)
    if argv and argv[0] in PYTHONS and sys.executable:
        argv[0] = sys.executable
    return argv


class _StderrTail:
    """A stdio server's stderr (mcp's `errlog`): a pipe whose lines a daemon thread copies to this process's stderr
    as they come (the server's log is shown as before), keeping the last `STDERR_LINES` for error messages."""

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        self.file = os.fdopen(write_fd, "w")  # the server's stderr; ours is closed once it runs (`detach`)
        self._lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._thread = threading.Thread(target=self._copy, args=(read_fd,), name="dppo-mcp-stderr", daemon=True)
        self._thread.start()

    def _copy(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:  # until every write end is closed: the server's exited and ours detached
                line = raw.decode(errors="replace")
                if line.strip():
                    self._lines.append(line.rstrip()[:300])
                try:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                except (OSError, ValueError):  # (a closed stderr: the line is kept all the same)
                    pass

    def detach(self) -> None:
        """Close this process's write end (idempotent): the pipe ends when the server's process does."""
        if not self.file.closed:
            self.file.close()

    def tail(self, wait_s: float = 0.0) -> str:
        """The last lines, ` | `-joined (after waiting up to `wait_s` for the pipe to end)."""
        if wait_s > 0 and self.file.closed:
            self._thread.join(wait_s)
        return " | ".join(self._lines)


class MCPTool:
    """One tool of the server as a dppo tool: calling it runs tools/call; `tool_schema` is the server's schema."""

    def __init__(self, session: MCPSession, tool, timeout_s: float) -> None:
        self.__name__, self.session, self.timeout_s = tool.name, session, timeout_s
        self.tool_schema = {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                             "parameters": tool.input_schema}}

    def __call__(self, **arguments: Any) -> str:
        # `call_tool` (ToolEnv.step) answers a timeout at timeout_s; its abandoned thread cancels the request a
        # little later, so that the two clocks never race for which one names the timeout
        return self.session.call(self.__name__, arguments, self.timeout_s + CANCEL_AFTER_S)

    def __repr__(self) -> str:
        return f"MCPTool({self.__name__!r})"


_SESSIONS: dict[str, MCPSession] = {}
"""Live sessions of this process by their connection options (JSON), shared by the factories that name them."""
_SESSIONS_LOCK = threading.Lock()


def _close_all() -> None:
    for session in list(_SESSIONS.values()):
        session.close()


atexit.register(_close_all)


def _connection(command, url, env, cwd) -> tuple[str, Any, str, list[str] | None]:
    """(the key of a connection, what `mcp.Client` connects to, the option to name in errors, the stdio command as
    run), options checked."""
    if (command is None) == (url is None):
        raise ValueError("command: give exactly one of command (a stdio server to launch) or url (an HTTP server)")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http:// or https:// URL, got {url!r}")
        if env is not None or cwd is not None:
            raise ValueError(f"{'env' if env is not None else 'cwd'}: only for a stdio server (command), not a url")
        return json.dumps({"url": url}), url, "url", None
    argv = shlex.split(command) if isinstance(command, str) else command
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) and a for a in argv)):
        raise ValueError(f"command: expected a non-empty list of strings (or one string), got {command!r}")
    argv = resolve_command(argv)
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                             for k, v in env.items())):
        raise ValueError(f"env: expected a JSON object of strings, got {env!r}")
    if cwd is not None and not (isinstance(cwd, str) and Path(cwd).is_dir()):
        raise ValueError(f"cwd: not a directory: {cwd!r}")
    return json.dumps({"command": argv, "env": env, "cwd": cwd}, sort_keys=True), None, "command", argv


def connect(*, command=None, url=None, env=None, cwd=None, connect_timeout_s: float = 30.0) -> MCPSession:
    """The live session of this process to the server named, connecting (a new session) when there is none."""
    if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
        raise ValueError(f"connect_timeout_s: expected > 0, got {connect_timeout_s!r}")
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ValueError(f"{'url' if url is not None else 'command'}: the mcp environment needs the 'mcp' package "
                         f"(2.x): pip install 'mcp>=2'") from None
    key, server, option, argv = _connection(command, url, env, cwd)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None or not session.alive:
            if session is not None:
                session.close()  # (its server is gone: end its loop thread too)
            stderr = None
            if argv is not None:  # a stdio server, launched by this session: its stderr through a pipe of ours
                from mcp import StdioServerParameters, stdio_client

                stderr = _StderrTail()
                server = stdio_client(StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd),
                                      errlog=stderr.file)
            session = _SESSIONS[key] = MCPSession(server, option=option, connect_timeout_s=connect_timeout_s,
                                                  name=shlex.join(argv) if argv is not None else url, stderr=stderr)
    return session


class MCPFactory:
    """Builds one fresh `MCPEnv` per call, all on one server session (`make_environment("mcp", ...)` returns one)."""

    def __init__(self, session: MCPSession, tools: tuple[MCPTool, ...], score, options: dict) -> None:
        self.session, self.tools, self._score, self._options = session, tools, score, options

    def __call__(self) -> "MCPEnv":
        return MCPEnv(tools=self.tools, score=self._score, **self._options)

    def close(self) -> None:
        """Close the server session (shared with the factories of this process that name the same server)."""
        with _SESSIONS_LOCK:
            for key in [k for k, s in _SESSIONS.items() if s is self.session]:
                del _SESSIONS[key]
        self.session.close()


class MCPEnv(ToolEnv):
    """A tool environment whose tools are an MCP server's (see the module docstring); built by `MCPEnv.factory`."""

    def __init__(self, *, tools: Sequence[MCPTool], score, system_prompt: str = DEFAULT_SYSTEM, **limits) -> None:
        super().__init__(**limits)
        self.tools, self._score, self.system_prompt = tuple(tools), score, system_prompt

    @classmethod
    def factory(cls, *, command: str | list[str] | None = None, url: str | None = None,
                env: dict[str, str] | None = None, cwd: str | None = None, tools: list[str] | None = None,
                reward: str = "last_number", system_prompt: str = DEFAULT_SYSTEM, connect_timeout_s: float = 30.0,
                max_tool_chars: int = 1000, tool_timeout_s: float = 10.0, max_calls_per_turn: int = 4) -> MCPFactory:
        """Connect to the server (or share this process's session to it) and return the factory of its episodes.

        command: a stdio server to launch (a list of arguments, or one string split like a shell's); url: a
        streamable-HTTP server (exactly one of the two). env: environment variables added to the few a stdio server
        inherits (mcp's default: HOME, PATH, ...); cwd: its working directory. tools: the tools offered (default: all
        of the server's, but a reward tool). reward: how the final answer is scored (module docstring).
        system_prompt: the system message put before an example's prompt that has none ("" for none).
        connect_timeout_s: the longest the launch, handshake and tools/list may take.
        """
        limits = {"max_tool_chars": max_tool_chars, "tool_timeout_s": tool_timeout_s,
                  "max_calls_per_turn": max_calls_per_turn}
        ToolEnv(**limits)  # (checks them, naming the field)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, str) for t in tools)):
            raise ValueError(f"tools: expected a list of tool names, got {tools!r}")
        if not isinstance(reward, str) or not reward:
            raise ValueError(f"reward: expected a reward name, an import path or 'tool:NAME', got {reward!r}")
        if not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string, got {type(system_prompt).__name__}")
        reward_tool = reward[len(REWARD_TOOL):] if reward.startswith(REWARD_TOOL) else None
        if reward_tool is None:
            try:
                reward_fn = get_reward(reward)
            except ValueError as err:
                raise ValueError(f"reward: {err}") from None
        session = connect(command=command, url=url, env=env, cwd=cwd, connect_timeout_s=connect_timeout_s)
        offered = {t.name: t for t in session.tools}
        unknown = sorted(set(tools or ()) - set(offered))
        if unknown:
            raise ValueError(f"tools: the server has no tool(s) {unknown}; it offers {sorted(offered)}")
        if reward_tool is not None and reward_tool not in offered:
            raise ValueError(f"reward: the server has no tool {reward_tool!r}; it offers {sorted(offered)}")
        names = tools if tools is not None else [n for n in offered if n != reward_tool]
        chosen = tuple(MCPTool(session, offered[n], tool_timeout_s) for n in names)
        if reward_tool is not None:
            score = _ToolScore(MCPTool(session, offered[reward_tool], tool_timeout_s))
        else:
            score = reward_fn
        return MCPFactory(session, chosen, score, {"system_prompt": system_prompt, **limits})

    def reset(self, example: Example) -> list[Message]:
        messages = super().reset(example)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def score(self, answer: str) -> float:
        return float(self._score(answer, self.example))


class _ToolScore:
    """A reward that is a tool of the server: called with the answer and the gold answer; its text is the reward."""

    def __init__(self, tool: MCPTool) -> None:
        self.tool = tool

    def __call__(self, answer: str, example: Example) -> float:
        text = self.tool(answer=answer, gold=str(example.answer))
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"reward tool {self.tool.__name__} answered {text!r:.200}, not a number") from None


__all__ = ["MCPEnv", "MCPFactory", "MCPSession", "MCPTool", "MCPToolError", "PYTHONS", "connect", "resolve_command",
           "result_text"]
