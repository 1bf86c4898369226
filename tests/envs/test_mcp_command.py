"""The "mcp" environment's stdio command (`dppo.envs.mcp`): a bare `python` / `python3` is the run's own interpreter
(`sys.executable`, where `mcp` is installed), not the first python on PATH; a server process that does not start or
exits at once fails make_environment naming its command and quoting its stderr's last lines; a server that dies
mid-episode is named in the tool message."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp environment needs the mcp package (2.x)")

from dppo.envs import make_environment  # noqa: E402
from dppo.envs.mcp import resolve_command  # noqa: E402
from dppo.example import Example  # noqa: E402

SERVER = str(Path(__file__).resolve().parents[1] / "data" / "mcp_server.py")


def test_a_bare_python_is_the_runs_interpreter_and_anything_else_is_run_as_given():
    assert resolve_command(["python", "tools_server.py"]) == [sys.executable, "tools_server.py"]
    assert resolve_command(["python3", "-m", "tools"]) == [sys.executable, "-m", "tools"]
    for argv in (["/usr/bin/python3", "s.py"], [".venv/bin/python", "s.py"], ["python3.11", "s.py"],
                 ["uvx", "python"], ["node", "server.js"]):
        assert resolve_command(argv) == argv
    argv = ["python", "s.py"]
    resolve_command(argv)
    assert argv == ["python", "s.py"]  # (a copy: the caller's list is left alone)


def test_python_on_the_command_runs_the_server_with_the_runs_interpreter(tmp_path):
    """The first `python` on the server's PATH is one without mcp (here: one that fails at once): the server still
    starts, with sys.executable."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'the wrong python' >&2\nexit 9\n")
    fake.chmod(0o755)
    made = make_environment("mcp", command=["python", SERVER], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                            tools=["add"])
    try:
        assert made.tools[0](a=2, b=3) == "5"
    finally:
        made.close()
    made = make_environment("mcp", command=f"python3 {shlex.quote(SERVER)}", env={"PATH": str(tmp_path)},
                            tools=["add"])  # (one string, split like a shell's)
    try:
        assert made.tools[0](a=1, b=1) == "2"
    finally:
        made.close()


def test_a_server_that_exits_at_once_is_named_with_its_stderr():
    command = [sys.executable, "-c", "import sys; print('boot failed: no module named mcp', file=sys.stderr); "
                                     "sys.exit(3)"]
    with pytest.raises(ValueError) as caught:
        make_environment("mcp", command=command)
    message = str(caught.value)
    assert message.startswith("environment 'mcp': command: cannot connect to the MCP server: ")
    assert f"[server: {shlex.join(command)}; its stderr ended: boot failed: no module named mcp]" in message


def test_a_command_that_does_not_start_is_named():
    with pytest.raises(ValueError, match=r"^environment 'mcp': command: cannot connect to the MCP server: .*No such "
                                         r"file.* \[server: /no/such/mcp-server --flag\]$"):
        make_environment("mcp", command=["/no/such/mcp-server", "--flag"])


def test_a_server_that_dies_mid_episode_is_named_in_the_tool_message():
    made = make_environment("mcp", command=[sys.executable, SERVER], env={"DPPO_MCP_TEST": "names-it"})
    try:
        env = made()
        env.reset(Example(prompt="2+3?", answer="5"))
        crash = json.dumps({"name": "crash", "arguments": {}})
        content = env.step(f"<tool_call>{crash}</tool_call>").messages[0]["content"]
        assert content.startswith("Error: MCPToolError: the MCP server did not answer: MCPError: Connection closed")
        assert f"[server: {shlex.join([sys.executable, SERVER])}]" in content
        later = env.step(f"<tool_call>{crash}</tool_call>").messages[0]["content"]
        assert later.startswith("Error: MCPToolError: the MCP server is gone") and SERVER in later
    finally:
        made.close()
