"""The "mcp" environment (`dppo.envs.mcp`) against a real MCP server (tests/data/mcp_server.py, the `mcp` package's
MCPServer over stdio, and over streamable HTTP in a subprocess): tools/list becomes the tools offered with the
server's schemas, tools/call becomes tool messages with dppo's caps, timeouts and errors (an isError result, a hang,
a server that died: error messages counted, never a raise); the allow-list, the reward, bad options and unreachable
servers failing at make_environment naming the option; and two trainer steps end to end."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp environment needs the mcp package (2.x)")

from dppo.envs import make_environment  # noqa: E402
from dppo.envs.mcp import MCPEnv  # noqa: E402
from dppo.envs.tools import tool_schema  # noqa: E402
from dppo.episodes.chat import ChatCodec  # noqa: E402
from dppo.example import Example  # noqa: E402

SERVER = str(Path(__file__).resolve().parents[1] / "data" / "mcp_server.py")
COMMAND = [sys.executable, SERVER]
EXAMPLE = Example(prompt="2+3?", answer="5")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def factory():
    """The stdio server's factory: every tool offered, short timeouts and a small output cap."""
    made = make_environment("mcp", command=COMMAND, tool_timeout_s=0.5, max_tool_chars=60, max_calls_per_turn=8)
    yield made
    made.close()


def test_tools_list_becomes_the_tools_offered_with_the_servers_schemas(factory, tokenizer):
    env = factory()
    names = [t.__name__ for t in env.tools]
    assert names == ["add", "slow", "fail", "big", "where", "crash", "score", "digits"]
    schema = tool_schema(env.tools[0])
    assert schema["type"] == "function" and schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    messages = env.reset(EXAMPLE)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "2+3?"
    # the episode runner's first prompt: the schemas rendered as the template's tools text
    prompt = tokenizer.decode(ChatCodec(tokenizer).render(messages, [tool_schema(t) for t in env.tools]))
    assert '"name": "add"' in prompt and '"description": "Add two integers."' in prompt


def test_calls_are_tool_messages_and_errors_timeouts_and_caps_are_answers_counted(factory):
    env = factory()
    env.reset(EXAMPLE)
    t0 = time.monotonic()
    step = env.step(call("add", a=2, b=3) + call("fail", message="boom") + call("slow", seconds=5)
                    + call("big", n=500) + call("nope") + call("add", a="x", b=1))
    assert time.monotonic() - t0 < 3  # the slow call is abandoned at tool_timeout_s
    contents = [m["content"] for m in step.messages]
    assert all(m["role"] == "tool" for m in step.messages) and not step.done
    assert contents[0] == "5"
    assert contents[1] == "Error: MCPToolError: Error executing tool fail: boom"
    assert contents[2] == "Error: tool slow timed out after 0.5s"
    assert contents[3] == "x" * 60 + "\n[truncated: 440 more characters]"
    assert contents[4].startswith("Error: unknown tool 'nope'; valid tools: add, big, crash")
    assert contents[5].startswith("Error: MCPToolError: ") and "add" in contents[5]  # the server validates
    # (truncated: the big output, and the long unknown-tool and validation messages)
    assert step.info == {"tool_calls": 6.0, "tool_errors": 4.0, "tool_timeouts": 1.0, "tool_truncated": 3.0}
    assert env.step(call("add", a=1, b=1)).messages[0]["content"] == "2"  # the timed-out call did not stall it
    with pytest.raises(TimeoutError, match="tool slow timed out after 0.2s"):  # cancelled on the server, which
        factory.session.call("slow", {"seconds": 5}, timeout_s=0.2)            # answers the next call as before
    assert factory.session.call("add", {"a": 2, "b": 2}, timeout_s=5) == "4"
    final = env.step("The answer is 5")  # no tool call: the final answer, scored by last_number (the default)
    assert final.done and final.reward == 1.0


def test_a_server_tool_can_be_the_reward_and_is_then_not_offered():
    made = make_environment("mcp", command=COMMAND, reward="tool:score", system_prompt="")
    env = made()
    assert "score" not in [t.__name__ for t in env.tools]
    assert env.reset(EXAMPLE) == [{"role": "user", "content": "2+3?"}]  # no system prompt
    assert env.step("so 5").reward == 1.0
    env.reset(EXAMPLE)
    assert env.step("so 6").reward == 0.0
    offered = make_environment("mcp", command=COMMAND, reward="tool:score", tools=["add", "score"])
    assert [t.__name__ for t in offered().tools] == ["add", "score"]  # listed explicitly: offered
    assert made.session is offered.session  # one server per process for factories that name it


def test_the_allow_list_offers_only_the_tools_named_and_calls_of_others_are_unknown(factory):
    env = make_environment("mcp", command=COMMAND, tools=["big", "add"])()
    assert [t.__name__ for t in env.tools] == ["big", "add"]
    env.reset(EXAMPLE)
    step = env.step(call("crash"))
    assert step.messages[0]["content"] == "Error: unknown tool 'crash'; valid tools: add, big"
    assert factory.session.alive


def test_env_and_cwd_reach_the_stdio_server(tmp_path):
    made = make_environment("mcp", command=COMMAND, env={"DPPO_MCP_TEST": "yes"}, cwd=str(tmp_path))
    try:
        tools = {t.__name__: t for t in made.tools}
        assert tools["where"](name="DPPO_MCP_TEST") == f"{tmp_path} yes"
    finally:
        made.close()
    assert not made.session.alive


def test_a_server_that_dies_is_an_error_message_and_the_next_factory_connects_anew():
    options = {"command": COMMAND, "env": {"DPPO_MCP_TEST": "dies"}}  # (its own server, not the shared one)
    made = make_environment("mcp", **options)
    env = made()
    env.reset(EXAMPLE)
    step = env.step(call("crash"))
    assert step.messages[0]["content"] == ("Error: MCPToolError: the MCP server did not answer: MCPError: "
                                           f"Connection closed [server: {shlex.join(COMMAND)}]")
    assert step.info["tool_errors"] == 1.0 and not made.session.alive
    later = env.step(call("add", a=1, b=2))  # at once, without waiting for a timeout
    assert later.messages[0]["content"].startswith("Error: MCPToolError: the MCP server is gone")
    again = make_environment("mcp", **options)
    assert again.session is not made.session and {t.__name__: t for t in again.tools}["add"](a=1, b=2) == "3"
    again.close()


@pytest.mark.parametrize("options, match", [
    ({}, r"command: give exactly one of command .* or url"),
    ({"command": COMMAND, "url": "http://127.0.0.1:1/mcp"}, r"command: give exactly one"),
    ({"url": "ftp://x"}, r"url: expected an http:// or https:// URL"),
    ({"url": "http://127.0.0.1:1/mcp", "cwd": "."}, r"cwd: only for a stdio server"),
    ({"command": []}, r"command: expected a non-empty list of strings"),
    ({"command": COMMAND, "env": {"A": 1}}, r"env: expected a JSON object of strings"),
    ({"command": COMMAND, "cwd": "/no/such/dir"}, r"cwd: not a directory"),
    ({"command": COMMAND, "tools": "add"}, r"tools: expected a list of tool names"),
    ({"command": COMMAND, "tools": ["add", "nope", "zz"]}, r"tools: the server has no tool\(s\) \['nope', 'zz'\]; "
                                                           r"it offers \['add', 'big', "),
    ({"command": COMMAND, "reward": "nope"}, r"reward: unknown reward 'nope'"),
    ({"command": COMMAND, "reward": "tool:nope"}, r"reward: the server has no tool 'nope'"),
    ({"command": COMMAND, "max_tool_chars": 0}, r"max_tool_chars: expected >= 1"),
    ({"command": COMMAND, "connect_timeout_s": 0}, r"connect_timeout_s: expected > 0"),
    ({"command": COMMAND, "bogus": 1}, r"unknown option\(s\) \['bogus'\]"),
    ({"command": ["/no/such/mcp-server"]}, r"command: cannot connect to the MCP server: .*No such file"),
    ({"command": [sys.executable, "-c", "pass"]}, r"command: cannot connect to the MCP server: MCPError: Connection "
                                                  r"closed"),
    ({"command": [sys.executable, "-c", "import sys; sys.stdin.read()"], "connect_timeout_s": 1},  # never answers
     r"command: no MCP handshake and tools/list within connect_timeout_s=1s"),
    ({"url": "http://127.0.0.1:1/mcp"}, r"url: cannot connect to the MCP server: ConnectError"),
])
def test_bad_options_and_unreachable_servers_fail_at_make_environment_naming_the_option(options, match):
    with pytest.raises(ValueError, match=rf"^environment 'mcp': {match}"):
        make_environment("mcp", **options)


def test_without_the_mcp_package_the_error_names_the_option_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # (import mcp raises ImportError)
    with pytest.raises(ValueError, match=r"^environment 'mcp': url: the mcp environment needs the 'mcp' package "
                                         r"\(2\.x\): pip install 'mcp>=2'$"):
        make_environment("mcp", url="http://127.0.0.1:1/mcp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_streamable_http_server_and_its_death_mid_run():
    port = _free_port()
    server = subprocess.Popen([*COMMAND, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the HTTP server did not start"
                time.sleep(0.05)
        made = make_environment("mcp", url=f"http://127.0.0.1:{port}/mcp", tools=["add", "fail"], tool_timeout_s=5)
        env = made()
        env.reset(EXAMPLE)
        step = env.step(call("add", a=20, b=22) + call("fail", message="no"))
        assert [m["content"] for m in step.messages] == ["42", "Error: MCPToolError: Error executing tool fail: no"]
        server.kill()
        server.wait()
        step = env.step(call("add", a=1, b=1))
        assert step.messages[0]["content"].startswith("Error: MCPToolError: the MCP server did not answer")
        assert step.info["tool_errors"] == 1.0 and step.info["tool_timeouts"] == 0.0
        made.close()
    finally:
        server.kill()
        server.wait()


def test_two_trainer_steps_end_to_end(tmp_path):
    """The stdio server's tools in the prompt of every episode, each final answer scored by the server's score tool;
    the trainer's start-up check and its collector share one server."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    options = {"command": COMMAND, "tools": ["add"], "reward": "tool:digits", "system_prompt": "",
               "env": {"DPPO_MCP_TEST": "trainer"}}
    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "max_new_tokens": 4},
                       env={"name": "mcp", "options": json.dumps(options), "max_turns": 2, "max_tokens": 60},
                       train={"threads": 1, "steps": 2, "mini_batches": 1})
    with Trainer(cfg, tmp_path) as trainer:
        before = [p.detach().clone() for p in trainer.params]
        metrics = [trainer.step() for _ in range(2)]
        moved = [not (a == p.detach()).all() for a, p in zip(before, trainer.params)]
    assert all(moved)
    for m in metrics:
        assert m["episode/turns_mean"] >= 1.0 and 0.0 <= m["reward/mean"] <= 1.0
    session = make_environment("mcp", **options).session
    assert session.alive
    session.close()
