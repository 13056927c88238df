"""Sampling profiles of a benchmark target's processes during its trial (py-spy), and their top entries.

`python -m bench.run ... --profile DIR` records, for every trial of a kvroute target, its router
replica (all threads) with `py-spy record --format raw` and writes the collapsed stacks to DIR plus
a summary of the top entries by inclusive and by own samples, and the CPU seconds each of the
process's threads used during the trial (`<stem>.threads.txt`, from /proc: Ray's C++ threads —
gRPC, the core worker's io_service — run no Python and are invisible to py-spy's Python stacks).
`--profile-native` adds C/C++ frames (py-spy `--native`), which splits what a Python-only profile
shows as the event loop's own time (uvloop, the kernel's socket calls, C parsers):

    python -m bench.profile DIR/<file>.txt [--top 30]     # summarize a recorded profile again

py-spy samples only threads that are running (idle waits are not samples), so the shares are of
the process's busy time; the sample count over the trial gives its absolute weight.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def find_pid(pattern: str) -> int | None:
    """The first process whose command line matches `pattern` (a regex)."""
    pat = re.compile(pattern)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if pat.search(" ".join(p.info["cmdline"] or ())):
                return p.info["pid"]
        except psutil.Error:
            continue
    return None


def py_spy() -> str:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise RuntimeError("py-spy is not installed: pip install -e '.[bench]'")
    return exe


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) each thread of `pid` has used so far, with its name: tid → (name, s)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        # "tid (comm) state ..." — comm may hold spaces and parentheses: split at the last ")"
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def thread_table(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
                 requests: int | None = None, py_names: dict[int, str] | None = None) -> str:
    """CPU per thread between two `thread_cpu` samples, busiest first; threads that used < 0.1 % of a
    core are summed in one row. `py_names` (tid → Python thread name, from a py-spy profile) tells
    the Python threads apart: the OS name of a thread is its process's title when it was started."""
    py_names = py_names or {}
    rows = []
    for tid, (name, cpu) in after.items():
        rows.append((max(0.0, cpu - before.get(tid, (name, 0.0))[1]), tid, name, py_names.get(tid, "")))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    def per_req(cpu: float) -> str:
        return f" {cpu / requests * 1e3:>7.2f}" if requests else ""

    def pct(cpu: float) -> str:
        return f"{cpu / max(seconds, 1e-9) * 100:>7.2f}"
    lines = [f"process CPU by thread over {seconds:.1f} s" + (f", {requests} requests" if requests else ""),
             f"{'tid':>8} {'OS name':<16} {'Python thread':<24} {'cpu s':>7} {'% core':>7}"
             + (f" {'ms/req':>7}" if requests else "")]
    small = [r for r in rows if r[0] / max(seconds, 1e-9) < 0.001]
    for cpu, tid, name, py in (r for r in rows if r not in small):
        lines.append(f"{tid:>8} {name:<16} {py[:24]:<24} {cpu:>7.2f} {pct(cpu)}{per_req(cpu)}")
    rest = sum(r[0] for r in small)
    lines.append(f"{'':>8} {f'{len(small)} others':<16} {'':<24} {rest:>7.2f} {pct(rest)}{per_req(rest)}")
    lines.append(f"{'':>8} {'total':<16} {'':<24} {total:>7.2f} {pct(total)}{per_req(total)}")
    return "\n".join(lines) + "\n"


_THREAD = re.compile(r"^thread \((?P<tid>\d+)\): (?P<name>.*)$")


def python_threads(raw: Path) -> dict[int, str]:
    """tid → Python thread name of the threads in a raw py-spy profile recorded with `--threads`."""
    out: dict[int, str] = {}
    for line in raw.read_text().splitlines():
        m = _THREAD.match(line.split(";", 1)[0])
        if m:
            out[int(m["tid"])] = m["name"]
    return out


class Recorder:
    """`py-spy record` on one process until `stop()`; the raw collapsed stacks land in `out`, and the
    CPU each of its threads used meanwhile in `out` with suffix `.threads.txt`."""

    def __init__(self, pid: int, out: Path, rate_hz: int = 250, *, native: bool = False) -> None:
        self.out = out
        self.pid = pid
        self._threads0 = thread_cpu(pid)
        self._t0 = time.monotonic()
        # native unwinding needs the process paused at each sample (py-spy refuses --native with
        # --nonblocking): it perturbs the process more, so it samples less often
        cmd = [py_spy(), "record", "-p", str(pid), "-r", str(min(rate_hz, 100) if native else rate_hz), "-f", "raw",
               "-o", str(out), "--threads", *(["--native"] if native else ["--nonblocking"])]
        self._log = out.with_suffix(".py-spy.log")
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)

    def stop(self, timeout_s: float = 30.0, requests: int | None = None) -> Path | None:
        threads, seconds = thread_cpu(self.pid), time.monotonic() - self._t0
        self._proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return None
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no profile of pid {self.pid}: {self._log.read_text()[-500:]}")
        self.out.with_suffix(".threads.txt").write_text(
            thread_table(self._threads0, threads, seconds, requests, python_threads(self.out)))
        return self.out


def _key(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m['fn']} ({Path(m['file']).name})" if m else frame


def summarize(raw: Path, top: int = 30) -> str:
    """Top entries of a raw py-spy profile: inclusive share (a function anywhere on the stack) and
    own share (the innermost frame), each of all samples."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        m = _THREAD.match(frames[0])
        if m:  # recorded with --threads: the first frame names the thread
            threads[f"{m['name']} ({m['tid']})"] += count
            frames = frames[1:] or ["(no frame)"]
        frames = [_key(f) for f in frames]
        for k in set(frames):
            incl[k] += count
        own[frames[-1]] += count
    if not total:
        return f"{raw.name}: no samples\n"
    lines = [f"{raw.name}: {total} samples", ""]
    if threads:
        lines += ["threads:", *(f"  {v / total * 100:5.1f}%  {k}" for k, v in threads.most_common(8)), ""]
    lines += ["inclusive:"]
    lines += [f"  {v / total * 100:5.1f}%  {k}" for k, v in incl.most_common(top)]
    lines += ["", "own:"]
    lines += [f"  {v / total * 100:5.1f}%  {k}" for k, v in own.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    for raw in args.raw:
        print(summarize(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
