"""Rollout engines: sample responses and record the log-probs of the distribution sampled from (µ).

`make_engine(name, ...)` builds one from the `ENGINES` registry (`dppo.rollout.settings`: each engine kind's settings
class, which names its engine class). Engines are imported only when made, so
`vllm` is imported only by `dppo.rollout.vllm` (and only when that engine is asked for).
"""

from __future__ import annotations

import importlib

from dppo.rollout.base import Engine, Rollout, SamplingParams
from dppo.rollout.settings import ENGINES



def engine_class(name: str) -> type:
    """The engine class registered under `name` (imports its module)."""
    if name not in ENGINES:
        raise ValueError(f"name: unknown engine {name!r}; valid names: {', '.join(sorted(ENGINES))}")
    module, cls = ENGINES[name].engine.split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, *args, **kwargs) -> Engine:
    """Build engine `name` with the given constructor arguments, e.g. `make_engine("hf", "tiny-random")`."""
    return engine_class(name)(*args, **kwargs)


__all__ = ["ENGINES", "Engine", "Rollout", "SamplingParams", "engine_class", "make_engine"]
