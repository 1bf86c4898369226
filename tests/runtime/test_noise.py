"""Third-party start-up noise (`dppo.runtime.noise`): the known lines go, every other line stays, in order, on
success and when the block raises."""

from __future__ import annotations

import os
import warnings

import pytest

from dppo.runtime.noise import filtered_stderr, progress_bars_wanted, quiet_third_party


def _write_fd2(text: str) -> None:
    os.write(2, text.encode())  # below Python, as a C++ extension writes


def test_filtered_stderr_drops_the_known_lines_and_keeps_the_rest_in_order(capfd):
    with filtered_stderr():
        _write_fd2("first line\n")
        _write_fd2("[W1202 21:10:25 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\n")
        _write_fd2("W1202 torch/_library/triton.py:53] Triton not available, find_triton_kernels = []\n")
        _write_fd2("last line\n")
    assert capfd.readouterr().err == "first line\nlast line\n"


def test_filtered_stderr_keeps_an_errors_output(capfd):
    with pytest.raises(RuntimeError, match="engine failed"):
        with filtered_stderr():
            _write_fd2("Traceback of the engine's own failure\n")
            raise RuntimeError("engine failed")
    assert capfd.readouterr().err == "Traceback of the engine's own failure\n"


def test_quiet_third_party_ignores_the_deprecated_reduce_op_warning_only():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning)
        warnings.warn("something the user should see", FutureWarning)
    assert [str(w.message) for w in caught] == ["something the user should see"]


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_model_loading_progress_bars_go_off_where_stderr_is_no_terminal():
    """transformers' "Loading weights" bar and huggingface_hub's bars redraw hundreds of times into a log file:
    off when the stream is no terminal, left as they are on a terminal."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    try:
        hf_logging.enable_progress_bar()
        enable_progress_bars()
        quiet_third_party(_Stream(tty=True))
        assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
        quiet_third_party(_Stream(tty=False))
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
        enable_progress_bars()
    assert progress_bars_wanted(_Stream(tty=True)) and not progress_bars_wanted(_Stream(tty=False))
    assert not progress_bars_wanted(object())  # a stream without isatty: no bars
