"""Two real SGLang engines behind `kvroute serve --fleet FILE` (attach mode, exact prefix mode with
the model's own tokenizer), as a user brings them up by hand (docs/real-engine.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.real_engine.engines import PAGE_SIZE, REPO, Engine, free_port

MODEL_NAME = "tiny"


def fleet_yaml(engines: list[Engine], model_dir: Path) -> str:
    """kvroute's default settings: its liveness probe fits SGLang's >= 1 s /health (issue 31)."""
    lines = ["workers:"]
    for e in engines:
        lines += [
            f"  - name: {e.name}",
            f"    url: {e.url}",
            f"    metrics_endpoint: {e.metrics_endpoint}",
            f"    kv_events_endpoint: {e.kv_events_endpoint}",
            f"    kv_events_replay_endpoint: {e.replay_endpoint}",
            f"    page_size: {PAGE_SIZE}",
        ]
    lines += [
        "router:",
        f"  tokenizer: hf:{model_dir}",
        f"  block_size: {PAGE_SIZE}",
    ]
    return "\n".join(lines) + "\n"


class KvrouteServe:
    """`kvroute serve --fleet FILE` as a subprocess (its own local Ray, torn down on SIGINT)."""

    def __init__(self, fleet_file: Path, workdir: Path, port: int | None = None) -> None:
        self.fleet_file = fleet_file
        self.port = port or free_port()
        self.log_path = workdir / "kvroute-serve.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "KvrouteServe":
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        for k in ("KVROUTE_API_KEY", "KVROUTE_ADMIN_KEY", "RAY_ADDRESS"):
            env.pop(k, None)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.cli", "serve", "--fleet", str(self.fleet_file), "--port", str(self.port)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_listening(self, timeout_s: float = 360.0) -> None:
        """kvroute serve listens once its workers answered (attach mode asks each for its models)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvroute serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            if "kvroute is listening on" in self.log_tail(100_000):
                return
            time.sleep(0.3)
        raise TimeoutError(f"kvroute serve not listening within {timeout_s} s:\n{self.log_tail()}")

    def workers(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.url}/workers", timeout=10)
        r.raise_for_status()
        return {w["name"]: w for w in r.json()["workers"]}

    def wait_workers(self, pred, timeout_s: float = 60.0, what: str = "workers") -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.workers()
                if pred(last):
                    return last
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"{what} not reached within {timeout_s} s; last /workers: {last}")

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/route", json=body, timeout=10)
        r.raise_for_status()
        return r.json()

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


_OVERLAP = re.compile(r"overlap=(\d+)/(\d+) blocks")


def overlap(decision: dict[str, Any]) -> int:
    """The leading prompt blocks the chosen worker holds by kvroute's exact index (0 if the reason
    names none)."""
    m = _OVERLAP.search(decision.get("reason", ""))
    return int(m.group(1)) if m else 0


def wait_for(pred, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s} s (last: {last!r})")


def bring_up(tmp: Path, model_dir: Path, names=("w1", "w2")):
    """Start the engines and kvroute serve together (kvroute marks the workers live when their
    engines answer); returns (engines, serve, startup seconds). Stops everything on failure."""

    engines = [Engine(n, model_dir, tmp, served_model_name=MODEL_NAME) for n in names]
    fleet_file = tmp / "fleet.yaml"
    fleet_file.write_text(fleet_yaml(engines, model_dir))
    serve = KvrouteServe(fleet_file, tmp)
    t0 = time.monotonic()
    for e in engines:
        e.start()
    serve.start()
    try:
        ready = {e.name: e.wait_ready() for e in engines}
        serve.wait_listening()
        serve.wait_workers(lambda ws: set(ws) == set(names) and all(w["state"] in ("live", "idle") for w in ws.values()),
                           60, what="both workers live")
    except BaseException:
        shut_down(engines, serve)
        raise
    ready["total"] = time.monotonic() - t0
    return engines, serve, ready


def shut_down(engines, serve) -> None:
    try:
        serve.stop()
    finally:
        for e in engines:
            e.stop()
