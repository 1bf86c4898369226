"""Diagnostics: the training–inference mismatch report by µ bucket (paper Fig. 2) and its plots.

`mismatch_report` (pure, tensors in) lives in `dppo.studies.diagnose.mismatch`; `run_diagnose` (sample with an
engine, recompute with the fp32 trainer, write JSON + PNGs) in `dppo.studies.diagnose.run`, imported lazily here
so that the pure part does not pull in the engines; `cmd_diagnose` (the `dppo diagnose` command) in
`dppo.studies.diagnose.cli`.
"""

from __future__ import annotations

from dppo.studies.diagnose.mismatch import DEFAULT_BUCKETS, METRICS, bucket_labels, mismatch_report, token_metrics

__all__ = ["DEFAULT_BUCKETS", "METRICS", "bucket_labels", "mismatch_report", "run_diagnose", "token_metrics"]


def __getattr__(name: str):
    if name == "run_diagnose":
        from dppo.studies.diagnose.run import run_diagnose

        return run_diagnose
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
