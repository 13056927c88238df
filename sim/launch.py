"""Start simulated workers from Python: as a child process (`SimProcess`) or in-process (`serve`).

    with SimProcess(SimConfig(port=free_port(), metrics_endpoint="ipc:///tmp/w1.metrics")) as w:
        httpx.get(w.url + "/health")

The child is `python -m sim …` with flags derived from the config (`sim_argv`), so what runs is
exactly what the CLI runs; `stop()` sends SIGTERM and waits for a clean exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import IO, Any

import httpx

from actors.ports import free_port  # re-exported: outside the ephemeral range (see there)
from sim.config import SimConfig
from sim.server import serve

__all__ = ["SimProcess", "free_port", "serve", "sim_argv"]


def sim_argv(config: SimConfig) -> list[str]:
    """The `python -m sim` command line that runs `config`."""
    e = config.engine
    argv = [
        sys.executable, "-m", "sim",
        "--host", config.host, "--port", str(config.port),
        "--model-name", config.model_name, "--wire", config.wire,
        "--time-scale", repr(config.time_scale),
        "--page-size", str(e.page_size),
        "--max-total-num-tokens", str(e.max_total_num_tokens),
        "--max-running-requests", str(e.max_running_requests),
        "--max-prefill-tokens", str(e.max_prefill_tokens),
        "--context-length", str(e.context_length),
        "--decode-log-interval", str(e.decode_log_interval),
        "--default-max-new-tokens", str(e.default_max_new_tokens),
        "--prefill-base-ms", repr(e.prefill_base_s * 1e3),
        "--prefill-per-token-us", repr(e.prefill_per_token_s * 1e6),
        "--decode-base-ms", repr(e.decode_base_s * 1e3),
        "--decode-per-req-us", repr(e.decode_per_req_s * 1e6),
        "--decode-per-kv-token-ns", repr(e.decode_per_kv_token_s * 1e9),
        "--dp-rank", str(e.dp_rank), "--seed", str(e.seed),
        "--kv-events-topic", config.kv_events_topic,
    ]
    if config.dp_size > 1:
        argv += ["--dp-size", str(config.dp_size)]
    if config.kv_events_encoding:
        argv += ["--kv-events-encoding", config.kv_events_encoding]
    if config.kv_events_bind is not None:
        argv += ["--kv-events-config", json.dumps({"bind": config.kv_events_bind})]
    if config.metrics_endpoint:
        argv += ["--metrics-endpoint", config.metrics_endpoint]
    if config.kv_events_endpoint:
        argv += ["--kv-events-endpoint", config.kv_events_endpoint]
    if config.kv_events_replay_endpoint:
        argv += ["--kv-events-replay-endpoint", config.kv_events_replay_endpoint]
    return argv


class SimProcess:
    """One `python -m sim` child. `start()` returns once `/health` answers (or raises)."""

    def __init__(
        self,
        config: SimConfig,
        *,
        log_level: str = "warning",
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.url = f"http://{config.host}:{config.port}"
        self._argv = sim_argv(config) + ["--log-level", log_level]
        self._stdout, self._stderr = stdout, stderr
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> "SimProcess":
        env = dict(os.environ if self._env is None else self._env)
        # the child must import `sim` even when the caller runs from another directory
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(self._argv, stdout=self._stdout, stderr=self._stderr, env=env)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"sim worker on port {self.config.port} exited with status {self.proc.returncode} "
                        f"during start-up (command: {' '.join(self._argv)})"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sim worker on port {self.config.port} not healthy after {timeout:.0f} s")

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "SimProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
