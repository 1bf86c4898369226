"""Rollout engines: sample responses and record the log-probs of the distribution sampled from (µ).

`make_engine(name, ...)` builds one from the `ENGINES` registry; `vllm` is imported only by its module.
"""

from dppo.rollout.base import Engine, Rollout, RolloutBatch, SamplingParams, collate

__all__ = ["Engine", "Rollout", "RolloutBatch", "SamplingParams", "collate"]
