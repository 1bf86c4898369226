"""scripts/slowest_tests.py: docs/testing.md's slowest-tests table rebuilt from a pytest log's `--durations` lines."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "slowest_tests", Path(__file__).resolve().parents[1] / "scripts" / "slowest_tests.py")
slowest = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(slowest)

LOG = """........ [100%]
============================= slowest 4 durations =============================
123.68s call     tests/train/test_learning.py::test_multi_turn
116.80s setup    tests/episodes/test_agent_learning.py::test_one_turn
10.00s teardown tests/rollout/test_x.py::test_y[a b]
0.50s call     tests/test_z.py::test_z
=========================== short test summary info ============================
1769 passed, 2 skipped, 1 warning in 1191.92s (0:19:51)
"""


def test_the_table_lists_the_slowest_phases_in_the_logs_order_under_its_summary_line(tmp_path):
    assert slowest.durations(LOG)[:2] == [(123.68, "call", "tests/train/test_learning.py::test_multi_turn"),
                                          (116.80, "setup", "tests/episodes/test_agent_learning.py::test_one_turn")]
    assert slowest.durations(LOG)[2] == (10.0, "teardown", "tests/rollout/test_x.py::test_y[a b]")
    assert slowest.summary(LOG) == "1769 passed, 2 skipped, 1 warning in 1191.92s (0:19:51)"
    doc = tmp_path / "testing.md"
    doc.write_text(f"before\n{slowest.BEGIN}\nold table\n{slowest.END}\nafter\n")
    assert slowest.main([str(_log(tmp_path)), "--rows", "2", "--doc", str(doc), "--date", "2026-12-07"]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{slowest.END}\nafter\n") and "old table" not in text
    rows = [line for line in text.splitlines() if line.startswith("| 1")]
    assert rows == ["| 123.7 | call | `train/test_learning.py::test_multi_turn` |",
                    "| 116.8 | setup | `episodes/test_agent_learning.py::test_one_turn` |"]
    assert "2026-12-07, `1769 passed, 2 skipped, 1 warning in 1191.92s (0:19:51)`" in text
    assert slowest.main([str(_log(tmp_path)), "--rows", "2", "--doc", str(doc), "--date", "2026-12-07", "--check"]) == 0
    assert slowest.main([str(_log(tmp_path)), "--rows", "3", "--doc", str(doc), "--date", "2026-12-07", "--check"]) == 1


def test_a_log_without_durations_or_a_doc_without_markers_is_refused(tmp_path):
    bare = tmp_path / "bare.log"
    bare.write_text("1 passed in 1.00s\n")
    assert slowest.main([str(bare), "--doc", str(tmp_path / "x.md")]) == 2
    with pytest.raises(ValueError, match="no <!-- slowest:begin -->"):
        slowest.replace_block("no markers", "table")


def _log(tmp_path):
    path = tmp_path / "run.log"
    path.write_text(LOG)
    return path
