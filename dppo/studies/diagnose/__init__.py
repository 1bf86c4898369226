"""Diagnostics: the training–inference mismatch report by µ bucket (paper Fig. 2) and its plots.

`mismatch_report` (pure, tensors in) lives in `dppo.studies.diagnose.mismatch`; `run_diagnose` (sample with an
engine, recompute with the fp32 trainer, write JSON + PNGs) in `dppo.studies.diagnose.run`; `cmd_diagnose` (the
`dppo diagnose` command) in `dppo.studies.diagnose.cli`.
"""

from __future__ import annotations

from dppo.studies.diagnose.mismatch import DEFAULT_BUCKETS, METRICS, bucket_labels, mismatch_report, token_metrics
from dppo.studies.diagnose.run import run_diagnose

__all__ = ["DEFAULT_BUCKETS", "METRICS", "bucket_labels", "mismatch_report", "run_diagnose", "token_metrics"]
