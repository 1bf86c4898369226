"""dppo's optional parts and the packages each needs (the extras of pyproject.toml): a config that asks for a part
whose packages are missing is refused before any compute, naming the field and the extra that installs them."""

from __future__ import annotations

import importlib.util

from dppo._checks import config_fail

EXTRAS: dict[str, tuple[str, ...]] = {
    # rollout.episodes agent: the recording proxy (FastAPI on uvicorn) and the clients agents get (httpx, openai)
    "agents": ("fastapi", "uvicorn", "httpx", "openai"),
    # environments from the field: a verifiers v1 taskset (rollout.episodes verifiers), an MCP server's tools
    # (env.name mcp), an OpenEnv environment (env.name openenv)
    "verifiers": ("verifiers",),
    "mcp": ("mcp",),
    "openenv": ("openenv",),
}
"""Extra -> the modules it provides, each the import name of a distribution the extra lists (one name for both)."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, field: str, part: str) -> None:
    """ConfigError naming `field` when a package of `extra` is missing: `part` (what the field asked for) needs it."""
    absent = missing(extra)
    if absent:
        config_fail(field, f"{part} needs {', '.join(absent)} (not installed): pip install 'dppo[{extra}]'")
