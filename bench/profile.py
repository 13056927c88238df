"""Sampling profiles of a benchmark target's processes during its trial (py-spy), and their top entries.

`python -m bench.run ... --profile DIR` records, for every trial of a kvroute target, its router
replica (all threads, native frames off) with `py-spy record --format raw` and writes the
collapsed stacks to DIR plus a summary of the top entries by inclusive and by own samples:

    python -m bench.profile DIR/<file>.txt [--top 30]     # summarize a recorded profile again

py-spy samples only threads that are running (idle waits are not samples), so the shares are of
the process's busy time; the sample count over the trial gives its absolute weight.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
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


class Recorder:
    """`py-spy record` on one process until `stop()`; the raw collapsed stacks land in `out`."""

    def __init__(self, pid: int, out: Path, rate_hz: int = 250) -> None:
        self.out = out
        self._proc = subprocess.Popen(
            [py_spy(), "record", "-p", str(pid), "-r", str(rate_hz), "-f", "raw", "-o", str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self, timeout_s: float = 30.0) -> Path | None:
        self._proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return None
        return self.out if self.out.exists() else None


def _key(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m['fn']} ({Path(m['file']).name})" if m else frame


def summarize(raw: Path, top: int = 30) -> str:
    """Top entries of a raw py-spy profile: inclusive share (a function anywhere on the stack) and
    own share (the innermost frame), each of all samples."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [_key(f) for f in stack.split(";")]
        for k in set(frames):
            incl[k] += count
        own[frames[-1]] += count
    if not total:
        return f"{raw.name}: no samples\n"
    lines = [f"{raw.name}: {total} samples", "", "inclusive:"]
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
