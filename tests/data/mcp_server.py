"""A small MCP server for tests/envs/test_mcp.py, written with the `mcp` package's MCPServer (FastMCP before mcp 2):
stdio by default, streamable HTTP on 127.0.0.1 with `--http PORT`."""

from __future__ import annotations

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("dppo-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def fail(message: str) -> str:
    """Raise an error with this message."""
    raise ValueError(message)


@server.tool()
def big(n: int) -> str:
    """A text of n characters."""
    return "x" * n


@server.tool()
def where(name: str) -> str:
    """The server's working directory and the environment variable `name`."""
    return f"{os.getcwd()} {os.environ.get(name)}"


@server.tool()
def crash() -> str:
    """End the server's process at once."""
    os._exit(3)


@server.tool()
def score(answer: str, gold: str) -> float:
    """1.0 when the answer ends with the gold answer."""
    return float(answer.strip().endswith(gold))


@server.tool()
def digits(answer: str, gold: str) -> float:
    """The fraction of the answer's characters that are digits (a reward a random model moves)."""
    return sum(c.isdigit() for c in answer) / max(len(answer), 1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
