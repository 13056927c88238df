"""What machine a benchmark ran on: CPU model, cores, memory (figures differ between VMs)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _proc_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows, else 'cpu n/a'."""
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "cpu n/a"


def memory_gb() -> float | None:
    kb = _proc_field("/proc/meminfo", "MemTotal")
    return round(int(kb.split()[0]) / 2**20, 1) if kb else None


def describe() -> str:
    """One line for a report header."""
    return (f"python {platform.python_version()}, {platform.machine()}, {cpu_model()}, "
            f"{os.cpu_count()} cores")
