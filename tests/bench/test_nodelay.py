"""The TCP_NODELAY LD_PRELOAD shim the benchmark builds for its second sglang-router targets."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from bench.nodelay import shim_path
from bench.sglang_peer import SGLANG_POLICIES, SGLANG_ROUTER_FLAGS, sglang_router_argv

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")

# a server that accepts one TCP connection and reports the accepted socket's TCP_NODELAY
_SERVER = r"""
import socket, sys
ls = socket.socket(socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET)
ls.bind(("::1" if sys.argv[1] == "6" else "127.0.0.1", 0)); ls.listen()
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), flush=True)
"""


def _accepted_nodelay(env: dict[str, str], family: str = "4") -> int:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, family], stdout=subprocess.PIPE, env=env, text=True)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("::1" if family == "6" else "127.0.0.1", port)):
            return int(proc.stdout.readline())
    finally:
        proc.wait(10)


def test_shim_is_built_outside_the_checkout_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_BUILD_DIR", str(tmp_path))
    first = shim_path()
    assert first.parent == tmp_path and first.suffix == ".so"
    mtime = first.stat().st_mtime_ns
    assert shim_path() == first and first.stat().st_mtime_ns == mtime  # not rebuilt


@pytest.mark.parametrize("family", ["4", "6"])
def test_accepted_sockets_get_tcp_nodelay_only_with_the_shim(family):
    if family == "6" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        plain = _accepted_nodelay(env, family)
    except OSError:
        pytest.skip("no loopback for this family")
    assert plain == 0  # the kernel default the peer router leaves in place
    assert _accepted_nodelay({**env, "LD_PRELOAD": str(shim_path())}, family) == 1


def test_both_router_variants_run_the_same_named_flags():
    for policy in SGLANG_POLICIES:
        argv = sglang_router_argv(policy, 1234, ("http://w0", "http://w1"), 5678)
        flags = SGLANG_ROUTER_FLAGS[policy]
        i = argv.index("--policy")
        assert tuple(argv[i:i + len(flags)]) == flags and argv[i + 1] == policy
