"""Plug-ins by import path: the one loader behind custom rewards and custom environments.

    load_object("mypkg.rewards:fn", kind="reward")            # a module on sys.path
    load_object("path/to/file.py:MyEnv", kind="environment")  # a file, imported under a stable private name

Every failure is a ValueError naming the plug-in kind, the spec and the problem (file not found, import failed,
attribute missing with what the module defines). Returns the object and the resolved file path (None for a module),
which reward worker processes use to import a file plug-in again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def is_import_path(spec: str) -> bool:
    """True for "module:attr" / "file.py:attr" specs (a registry name has no colon)."""
    module_part, _, attr = spec.rpartition(":")
    return bool(module_part and attr)


def is_file_spec(spec: str) -> bool:
    """True for "path/to/file.py:attr" (a file to import), False for "package.module:attr" or a registry name."""
    module_part, _, attr = spec.rpartition(":")
    return bool(module_part and attr) and (module_part.endswith(".py") or "/" in module_part or "\\" in module_part)


def absolute_spec(spec: str, base: Path) -> str:
    """`spec` with its file made absolute against `base` when it names a file ("path/to/file.py:attr"); any
    other spec unchanged. Pure: the file need not exist (loading it says so, naming the absolute path)."""
    if not is_file_spec(spec):
        return spec
    module_part, _, attr = spec.rpartition(":")
    return f"{(base / Path(module_part).expanduser()).resolve()}:{attr}"


def load_object(spec: str, *, kind: str) -> tuple[Any, str | None]:
    """The object named by "module.path:attr" or "path/to/file.py:attr" (attr may be dotted)."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"{kind} {spec!r}: expected 'package.module:name' or 'path/to/file.py:name'")
    if is_file_spec(spec):
        module, file_path = _load_file_module(module_part, spec, kind)
    else:
        file_path = None
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise ValueError(f"{kind} {spec!r}: cannot import module {module_part!r}: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(f"{kind} {spec!r}: {module_part!r} has no attribute {attr!r}; it defines {defined}")
        obj = getattr(obj, part)
    return obj, file_path


def _load_file_module(path_text: str, spec: str, kind: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{kind} {spec!r}: file not found: {path}")
    name = f"_dppo_{kind}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name], str(path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"{kind} {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    return module, str(path)
