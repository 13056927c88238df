"""Launching simulated prefill/decode SGLang servers (`python -m sim --disaggregation-mode …`) for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from actors.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Sim:
    proc: subprocess.Popen
    url: str
    port: int
    bootstrap_port: int | None

    def stats(self) -> dict:
        return httpx.get(self.url + "/sim/stats", timeout=5).json()["disagg"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sim(mode: str, *, time_scale: float = 0.1, timeout_s: float = 300.0, extra: list[str] = ()) -> Sim:
    """One sim in PD `mode` (prefill gets a free bootstrap port); waits until /health answers.
    `timeout_s`: its bootstrap (prefill) / waiting (decode) timeout, simulated seconds."""
    port = free_port()
    argv = [sys.executable, "-m", "sim", "--port", str(port), "--time-scale", str(time_scale),
            "--model-name", "pd-model", "--disaggregation-mode", mode, *extra]
    bport = None
    if mode == "prefill":
        bport = free_port()
        argv += ["--disaggregation-bootstrap-port", str(bport), "--disaggregation-bootstrap-timeout", str(timeout_s)]
    else:
        argv += ["--disaggregation-waiting-timeout", str(timeout_s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a loaded shared machine starts Python slowly
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sim ({mode}) exited: {proc.stderr.read().decode()}")
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sim ({mode}) never became healthy")
        time.sleep(0.05)
    return Sim(proc, url, port, bport)
