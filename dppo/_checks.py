"""Small argument checks shared by the pure modules: every failure is a ValueError naming the argument; and
`ConfigError`, the ValueError of an invalid configuration value (re-exported by `dppo.train.config`), here so that
the adapters (`dppo.integrations`) can raise and catch it without importing the trainer's package."""

from __future__ import annotations

import json

import torch
from torch import Tensor


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the field's dotted name."""


def config_fail(field_name: str, message: str) -> None:
    """Raise ConfigError "<field>: <message>" (the config sections' and component settings' one way to refuse)."""
    raise ConfigError(f"{field_name}: {message}")


def config_positive(section: str, **values: float) -> None:
    """ConfigError naming `section.<name>` for a value (not None) that is not > 0."""
    for name, value in values.items():
        if value is not None and not value > 0:
            config_fail(f"{section}.{name}", f"expected > 0, got {value!r}")


def config_json_object(name: str, text: str) -> dict:
    """`text` parsed as a JSON object; ConfigError naming the field otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        config_fail(name, f"expected a JSON object, got {type(value).__name__}")
    return value


def check_tensor(name: str, x, *, floating: bool = False, dtype: torch.dtype | None = None) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {x.dtype}")


def check_same(name: str, x: Tensor, ref_name: str, ref: Tensor, *, dtype: bool = True) -> None:
    """x must have ref's shape, device (and dtype unless dtype=False)."""
    if x.shape != ref.shape:
        raise ValueError(f"{name}: expected shape {tuple(ref.shape)} (as {ref_name}), got {tuple(x.shape)}")
    if x.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (as {ref_name}), got {x.device}")
    if dtype and x.dtype != ref.dtype:
        raise ValueError(f"{name}: expected dtype {ref.dtype} (as {ref_name}), got {x.dtype}")


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")


def check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: unknown value {value!r}; valid: {', '.join(sorted(choices))}")
