"""dppo.runtime.bounded: the one bounded-call helper behind rewards (isolation "thread"), tool calls and environment
steps. Each call ends "ok", "error" or "timeout"; a call past its limit is abandoned and its slot goes to the next;
at most `workers` run at once; the results come back in order."""

from __future__ import annotations

import threading
import time

import pytest

from dppo.runtime.bounded import Outcome, bounded_calls


def test_each_call_ends_ok_error_or_timeout_in_order():
    release = threading.Event()

    def boom():
        raise KeyError("broken")

    t0 = time.monotonic()
    out = bounded_calls([lambda: 1, boom, release.wait, lambda: "x"], timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0  # the hung call does not hold the batch
    assert [o.status for o in out] == ["ok", "error", "timeout", "ok"]
    assert out[0] == Outcome("ok", 1) and out[3].value == "x"
    assert isinstance(out[1].error, KeyError) and out[1].value is None
    assert out[2].value is None and out[2].error is None
    release.set()


def test_a_base_exception_is_returned_not_raised():
    def exits():
        raise SystemExit(3)

    [out] = bounded_calls([exits], timeout_s=1.0)
    assert out.status == "error" and isinstance(out.error, SystemExit)


def test_at_most_workers_run_at_once_and_a_timed_out_call_frees_its_slot():
    lock, running, peak = threading.Lock(), [0], [0]
    hang = threading.Event()

    def call(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            if i == 0:
                hang.wait()  # never returns in time: abandoned, and the next call takes its slot
            else:
                time.sleep(0.05)
            return i
        finally:
            with lock:
                running[0] -= 1

    out = bounded_calls([lambda i=i: call(i) for i in range(7)], timeout_s=0.5, workers=2)
    assert [o.status for o in out] == ["timeout"] + ["ok"] * 6
    assert [o.value for o in out[1:]] == list(range(1, 7))
    assert peak[0] <= 3  # two slots, plus the abandoned call still running in the background
    hang.set()


def test_each_calls_clock_starts_when_it_starts():
    """With one worker, five 0.1 s calls under a 0.3 s limit all finish: the limit is per call, not per batch."""
    out = bounded_calls([lambda: time.sleep(0.1) or "done" for _ in range(5)], timeout_s=0.3, workers=1)
    assert [o.status for o in out] == ["ok"] * 5


def test_no_limit_waits_and_an_empty_batch_returns_nothing():
    assert bounded_calls([lambda: time.sleep(0.2) or 7], timeout_s=None)[0].value == 7
    assert bounded_calls([], timeout_s=1.0) == []
    with pytest.raises(ValueError, match="^timeout_s"):
        bounded_calls([lambda: 1], timeout_s=0)


def test_threads_are_reused_between_batches_and_an_abandoned_one_rejoins():
    """The pool: a second batch runs on the first batch's threads (no thread start per call); a timed-out call's
    thread comes back to the pool once its call returns; each running call's thread is named after it."""
    together = threading.Barrier(8, timeout=5)  # the 8 calls of a batch run at once: 8 threads

    def call():
        together.wait()
        return threading.current_thread()

    first = [o.value for o in bounded_calls([call] * 8, timeout_s=5.0, name="pool-test")]
    second = [o.value for o in bounded_calls([call] * 8, timeout_s=5.0, name="pool-test")]
    assert {id(t) for t in second} == {id(t) for t in first} and len(set(map(id, first))) == 8  # (objects kept alive)
    assert sorted(t.name for t in second) == sorted(f"pool-test-{i}" for i in range(8))
    release, held = threading.Event(), []
    [hung] = bounded_calls([lambda: held.append(threading.current_thread()) or release.wait()], timeout_s=0.2)
    assert hung.status == "timeout"
    release.set()
    time.sleep(0.2)  # the abandoned call returns and its thread goes back to the pool
    together = threading.Barrier(9, timeout=5)
    third = {id(o.value) for o in bounded_calls([call] * 9, timeout_s=5.0)}
    assert {id(t) for t in first + held} <= third  # every idle thread taken, the abandoned one's too


def _in_child(conn) -> None:
    out = bounded_calls([lambda i=i: i * i for i in range(5)], timeout_s=5.0)
    conn.send([o.value for o in out])


def test_a_forked_child_runs_bounded_calls():
    """A child forked after the parent's pool has idle threads (which the child does not have) still runs calls."""
    import multiprocessing as mp

    bounded_calls([lambda: 1] * 4, timeout_s=5.0)  # idle threads in the parent's pool
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_in_child, args=(child,))
    proc.start()
    assert parent.poll(20), "the forked child's bounded calls did not return"
    assert parent.recv() == [0, 1, 4, 9, 16]
    proc.join(10)
    assert proc.exitcode == 0
