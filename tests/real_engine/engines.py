"""Real SGLang 0.5.23 servers on CPU for the real-engine lane, started as a user would by hand:
`python -m actors.sglang_launch` (kvroute's launcher, which fixes the scheduler's metrics address from
`KVROUTE_METRICS_IPC_NAME`) with the flags known to work on this 2-core CPU machine.

Each server gets, in its own environment only: `SGLANG_USE_CPU_ENGINE=1` (SGLang's CPU engine),
`OMP_NUM_THREADS=1` (two engines share two cores), and this lane's plain-torch stand-in for the two
`sgl_kernel` functions the CPU engine imports (`cpu_kernels/`, put first on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from actors.ports import free_port

REPO = Path(__file__).resolve().parents[2]
CPU_KERNELS = Path(__file__).resolve().parent / "cpu_kernels"
PAGE_SIZE = 16
MAX_TOTAL_TOKENS = 8192
MAX_RUNNING = 8
STARTUP_TIMEOUT_S = 300.0  # 20-35 s on a quiet 2-core machine; minutes when it is shared


def engine_env(metrics_ipc: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        "KVROUTE_METRICS_IPC_NAME": metrics_ipc,
        "PYTHONPATH": os.pathsep.join(p for p in (str(CPU_KERNELS), str(REPO), env.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.update(extra or {})
    return env


def launch_flags(model_dir: str | os.PathLike, port: int, kv_events_endpoint: str,
                 replay_endpoint: str | None = None, *, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 extra: list[str] | None = None) -> list[str]:
    """The flags known to work with SGLang 0.5.23 on this CPU (docs/real-engine.md)."""
    kv = {"publisher": "zmq", "topic": "kv-events", "endpoint": kv_events_endpoint}
    if replay_endpoint:
        kv["replay_endpoint"] = replay_endpoint
    return [
        "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
        "--disable-overlap-schedule", "--page-size", str(PAGE_SIZE),
        "--max-total-tokens", str(max_total_tokens), "--max-running-requests", str(MAX_RUNNING),
        "--mem-fraction-static", "0.05", "--enable-metrics", "--enable-cache-report", "--sleep-on-idle",
        "--kv-events-config", json.dumps(kv), *(extra or []),
    ]


@dataclass
class Engine:
    """One SGLang server process (its own process group: the scheduler and detokenizer are its
    children and go with it)."""

    name: str
    model_dir: Path
    workdir: Path
    port: int = field(default_factory=free_port)
    kv_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    max_total_tokens: int = MAX_TOTAL_TOKENS
    served_model_name: str | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_endpoint(self) -> str:
        return f"ipc://{self.workdir}/{self.name}.metrics"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def argv(self) -> list[str]:
        extra = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return [sys.executable, "-m", "actors.sglang_launch",
                *launch_flags(self.model_dir, self.port, self.kv_events_endpoint, self.replay_endpoint,
                              max_total_tokens=self.max_total_tokens, extra=extra)]

    def start(self) -> "Engine":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), cwd=REPO, env=engine_env(self.metrics_endpoint),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until the server answered /v1/models (its HTTP server and tokenizer are up) and
        a first /health (its scheduler answered a health-check generation)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine {self.name} not healthy within {timeout_s} s:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the server and its scheduler/detokenizer children)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # children left behind by a server that exited first
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_engines(engines: list[Engine], timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, float]:
    """Start them together (both load at once; ~20-35 s each here), wait for all; stop all on failure."""
    for e in engines:
        e.start()
    try:
        return {e.name: e.wait_ready(timeout_s) for e in engines}
    except BaseException:
        for e in engines:
            e.stop()
        raise
