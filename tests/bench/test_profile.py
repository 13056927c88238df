"""Profile summaries: py-spy raw stacks recorded with --threads, and per-thread CPU from /proc."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench.profile import python_threads, summarize, thread_cpu, thread_table

RAW = (
    "thread (101): AsyncIO Thread: default;Thread.run (threading.py:982);handle (app.py:10);write (libc.so.6) 6\n"
    "thread (101): AsyncIO Thread: default;Thread.run (threading.py:982);route (router.py:5) 3\n"
    "thread (100): MainThread;main_loop (worker.py:1) 1\n"
)


def test_summary_splits_threads_and_keeps_them_out_of_the_function_shares(tmp_path: Path):
    raw = tmp_path / "p.txt"
    raw.write_text(RAW)
    text = summarize(raw)
    assert "90.0%  AsyncIO Thread: default (101)" in text and "10.0%  MainThread (100)" in text
    assert "60.0%  write (libc.so.6)" in text  # own share of the innermost native frame
    assert "thread (" not in text.split("inclusive:")[1]
    assert python_threads(raw) == {101: "AsyncIO Thread: default", 100: "MainThread"}


def test_thread_cpu_sees_a_busy_thread_of_this_process_and_the_table_ranks_it_first():
    stop = time.monotonic() + 0.3
    tid: list[int] = []

    def spin() -> None:
        tid.append(threading.get_native_id())
        while time.monotonic() < stop:
            pass

    before = thread_cpu(os.getpid())
    t = threading.Thread(target=spin)
    t.start()
    t.join()
    after = thread_cpu(os.getpid()) | {tid[0]: ("spin", 0.25)}  # a thread that ended is gone from /proc
    table = thread_table(before, after, 0.3, requests=10, py_names={tid[0]: "spinner"})
    first = table.splitlines()[2].split()
    assert first[0] == str(tid[0]) and "spinner" in first
    assert table.splitlines()[-1].split()[0] == "total"
    assert any(cpu > 0 for _, cpu in thread_cpu(os.getpid()).values())
