"""Show the sglang-router delayed-ACK stall, and that the shim removes it, on loopback.

    python -m bench.nodelay.check [--requests 20] [--pcap-dir DIR]

Starts one simulated worker and two sglang-router (cache_aware, the benchmark's flags) in front of
it, one plain and one with the TCP_NODELAY shim preloaded; sends streamed chat requests one after
another on one keep-alive connection per router; prints, per router: the time to the first body
bytes, TCP_NODELAY of the accepted socket (read from the router's own socket with pidfd_getfd),
and — if tcpdump and tshark are installed — from a loopback capture, for each reused-connection
stream the gap between the response headers and the first body bytes and whether the body left
only after the client's ACK of the headers.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.nodelay import shim_path
from bench.sglang_peer import sglang_router_argv
from sim.launch import free_port

_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # x86_64 and aarch64 alike


def accepted_nodelay(pid: int, port: int) -> list[int]:
    """TCP_NODELAY of every established socket `pid` holds on local `port` (needs ptrace rights)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":
                inodes.add(f[9])
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        return []
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not (link.startswith("socket:[") and link[8:-1] in inodes):
                continue
            dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
            if dup < 0:
                continue
            s = socket.socket(fileno=dup)
            try:
                out.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            finally:
                s.close()
    finally:
        os.close(pidfd)
    return out


def stalls(pcap: Path, port: int) -> dict[str, Any]:
    """Per streamed request on a reused connection: headers → first body bytes, and whether a pure
    client ACK of the headers came ≥ 30 ms after them with the body right behind it."""
    out = subprocess.run(["tshark", "-r", str(pcap), "-Y", f"tcp.port=={port}", "-d", f"tcp.port=={port},http",
                          "-T", "fields", "-e", "tcp.stream", "-e", "frame.time_relative", "-e", "tcp.srcport",
                          "-e", "tcp.len", "-e", "http.request.method"], capture_output=True, text=True, check=True)
    streams: dict[str, list[tuple[float, bool, int, str]]] = {}
    for row in out.stdout.splitlines():
        f = (row.split("\t") + [""] * 5)[:5]
        streams.setdefault(f[0], []).append((float(f[1]), f[2] == str(port), int(f[3] or 0), f[4]))
    gaps, stalled = [], 0
    for pk in streams.values():
        n_req, i = 0, 0
        while i < len(pk):
            if pk[i][3] != "POST":
                i += 1
                continue
            n_req += 1
            j = i + 1
            while j < len(pk) and not (pk[j][1] and pk[j][2] > 0):
                j += 1  # the response headers
            k, ack = j + 1, None
            while k < len(pk) and not (pk[k][1] and pk[k][2] > 0):
                if not pk[k][1] and pk[k][2] == 0:
                    ack = pk[k][0]
                k += 1  # the first body bytes
            if k < len(pk) and n_req > 1:
                gaps.append((pk[k][0] - pk[j][0]) * 1e3)
                if ack is not None and (ack - pk[j][0]) >= 0.030 and pk[k][0] - ack < 0.001:
                    stalled += 1
            i = k
    gaps.sort()
    return {"streams": len(gaps), "stalled": stalled,
            "gap_p50_ms": gaps[len(gaps) // 2] if gaps else None, "gap_max_ms": gaps[-1] if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--pcap-dir", help="keep the captures here (default: a temp dir, removed)")
    ns = ap.parse_args()
    tmp = Path(ns.pcap_dir or tempfile.mkdtemp(prefix="kvroute-nodelay-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    capture = shutil.which("tcpdump") is not None and shutil.which("tshark") is not None
    procs: list[subprocess.Popen] = []
    wport = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["HF_HUB_OFFLINE"] = "1"
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "sim", "--port", str(wport)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        routers = {}
        for mode in ("plain", "nodelay"):
            port = free_port()
            renv = {**env, "LD_PRELOAD": str(shim_path())} if mode == "nodelay" else env
            p = subprocess.Popen(sglang_router_argv("cache_aware", port, (f"http://127.0.0.1:{wport}",), free_port()),
                                 env=renv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            routers[mode] = (port, p)
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
        for mode, (port, p) in routers.items():
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            pcap = tmp / f"{mode}.pcap"
            dump = None
            with httpx.Client(timeout=10, trust_env=False) as c:
                deadline = time.monotonic() + 120
                while True:  # ready: the router answers (it registers the worker first)
                    try:
                        if c.post(url, json={**body, "stream": False}).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{mode} router never became ready")
                    time.sleep(0.2)
                if capture:
                    dump = subprocess.Popen(["tcpdump", "-i", "lo", "-n", "-s", "200", "-w", str(pcap),
                                             f"tcp port {port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)
                ttfb = []
                for _ in range(ns.requests):
                    t0 = time.perf_counter()
                    with c.stream("POST", url, json=body) as r:
                        it = r.iter_raw()
                        next(it)
                        ttfb.append((time.perf_counter() - t0) * 1e3)
                        for _ in it:
                            pass
                nd = accepted_nodelay(p.pid, port)
            if dump is not None:
                time.sleep(0.5)
                dump.send_signal(signal.SIGINT)
                dump.wait(10)
            reused = sorted(ttfb[1:])
            line = (f"{mode:8s} accepted socket TCP_NODELAY={nd or '?'}; first body bytes p50 "
                    f"{reused[len(reused) // 2]:.1f} ms (reused connection, {len(reused)} requests)")
            if capture:
                s = stalls(pcap, port)
                line += (f"; capture: headers→body p50 {s['gap_p50_ms']:.1f} ms, max {s['gap_max_ms']:.1f} ms, "
                         f"{s['stalled']}/{s['streams']} streams released only by the client's delayed ACK")
            print(line, flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if not ns.pcap_dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
