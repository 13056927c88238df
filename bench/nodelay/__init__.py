"""Build the TCP_NODELAY LD_PRELOAD shim (`nodelay.c`) on demand; the .so is cached outside the repo.

`shim_path()` compiles `nodelay.c` with the system C compiler into a cache directory (default: the
temp dir, `kvroute-nodelay/`; `KVROUTE_BUILD_DIR` overrides) named by the source's hash, once, and
returns the library's path; `LD_PRELOAD=<it>` then makes every TCP socket the process accepts
TCP_NODELAY. Nothing built is ever written into the checkout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("nodelay.c")


def build_dir() -> Path:
    return Path(os.environ.get("KVROUTE_BUILD_DIR") or Path(tempfile.gettempdir()) / "kvroute-nodelay")


def shim_path(cc: str | None = None) -> Path:
    """The compiled shim (built now if this source has not been built yet)."""
    src = SOURCE.read_bytes()
    out = build_dir() / f"nodelay-{hashlib.sha256(src).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = cc or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) to build the TCP_NODELAY shim")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(tmp), str(SOURCE), "-ldl"],
                   check=True, capture_output=True)
    os.replace(tmp, out)  # atomic: concurrent builders never see a half-written library
    return out
