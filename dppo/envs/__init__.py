"""Environments of multi-turn episodes: the protocol (`dppo.envs.base`), tools (`dppo.envs.tools`), the sandbox
for model-written code (`dppo.envs.sandbox`), the built-ins (`dppo.envs.builtin`), an MCP server's tools
(`dppo.envs.mcp`) and OpenEnv environments (`dppo.envs.openenv`).

    factory = make_environment("calculator", max_tool_chars=500)   # checked now: options, the class
    env = factory()                                                 # one fresh Environment per episode

Built-in names (`ENVIRONMENTS`): calculator, python, feedback, mcp (the tools of an MCP server, stdio or
HTTP: `make_environment("mcp", command=["python", "server.py"])`) and openenv (an OpenEnv server's environment,
`dppo.envs.openenv`: `make_environment("openenv", base_url="http://...")` or `app="module:app"`). A user
environment by import path: `make_environment("mypkg.envs:MyEnv")` or `make_environment("path/to/file.py:MyEnv")` (a
subclass of `Environment`, or any class with `reset(example)` and `step(reply)`). docs/agents.md has a 20-line example.

A class with a `factory(**options)` classmethod builds its own factory: `make_environment` returns what that returns
(a callable giving one fresh environment per call), so the factory can hold what the episodes share, e.g. `mcp`'s
one server session.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dppo.envs.base import EnvStep, Environment, ToolEnv
from dppo.envs.builtin import CalculatorEnv, FeedbackEnv, PythonEnv
from dppo.envs.mcp import MCPEnv
from dppo.envs.openenv import OpenEnvEnv
from dppo.runtime.plugins import is_import_path, load_object

ENVIRONMENTS: dict[str, type] = {
    "calculator": CalculatorEnv,
    "python": PythonEnv,
    "feedback": FeedbackEnv,
    "mcp": MCPEnv,
    "openenv": OpenEnvEnv,
}


def environment_class(name: str) -> type:
    """The environment class of a registry name or import path (ValueError naming the problem)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if not is_import_path(name):
        raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(ENVIRONMENTS)}, or an import path "
                         "'package.module:Class' / 'path/to/file.py:Class'")
    cls, _ = load_object(name, kind="environment")
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"environment {name!r}: {cls!r} has no reset(example) and step(reply) methods")
    return cls


def make_environment(name: str, **options: Any) -> Callable[[], Environment]:
    """A factory of fresh environments `name` with `options`: the class's own `factory(**options)` classmethod's
    result when it has one, else one instance is built now. Either way unknown or invalid options fail here
    (ValueError naming the environment), before any model loads."""
    cls = environment_class(name)
    own = isinstance(inspect.getattr_static(cls, "factory", None), classmethod)
    build = cls.factory if own else cls
    params = inspect.signature(build).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ValueError(f"environment {name!r}: unknown option(s) {unknown}; accepted: {list(params)}")
    try:
        made = build(**options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"environment {name!r}: {err}") from err
    return made if own else (lambda: cls(**options))


__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "ToolEnv", "environment_class", "make_environment"]
