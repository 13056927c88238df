"""Launching and supervising a worker's engine process (managed mode): `sim` or real `sglang`.

Pure asyncio + subprocess (no Ray): the worker's actor holds one `ManagedProcess`. It starts the
engine as its child (own process group; killed by the kernel if the actor's process dies, so Ray's
restart of the actor never meets an orphan — it launches a new engine), waits for `/health`,
restarts it with backoff when it dies (bounded), and stops it with SIGTERM then SIGKILL after a grace
period.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from actors.fleet import WorkerSpec
from actors.ports import free_port
from actors.protocol import ManagedEngine

logger = logging.getLogger("kvroute.launcher")

SGLANG_METRICS_ENV = "KVROUTE_METRICS_IPC_NAME"
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # holds actors/ (actors.sglang_launch is stdlib-only)


class LaunchError(RuntimeError):
    """The engine process could not be started or never became healthy."""


def _flags(args: dict[str, Any]) -> list[str]:
    """`{"time_scale": 0.1, "enable_x": True}` → `["--time-scale", "0.1", "--enable-x"]`."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _pd_flags(spec: WorkerSpec) -> list[str]:
    """A PD role's server flags (docs/pd.md), unless engine_args already gives them (then they must agree)."""
    if spec.role == "both":
        return []
    given = spec.engine_args.get("disaggregation_mode")
    if given is not None and given != spec.role:
        raise LaunchError(f"worker {spec.name}: role {spec.role} but engine_args.disaggregation_mode {given}")
    port = spec.engine_args.get("disaggregation_bootstrap_port")
    if port is not None and spec.bootstrap_port is not None and int(port) != spec.bootstrap_port:
        raise LaunchError(f"worker {spec.name}: bootstrap_port {spec.bootstrap_port} but "
                          f"engine_args.disaggregation_bootstrap_port {port}")
    out = [] if given is not None else ["--disaggregation-mode", spec.role]
    if spec.role == "prefill" and port is None:
        out += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    return out


def build_command(spec: WorkerSpec, *, host: str, port: int, metrics_endpoint: str) -> tuple[list[str], dict[str, str]]:
    """The child's argv and extra environment, for `engine: sim` or `engine: sglang` (a PD role adds
    --disaggregation-mode and, for prefill, --disaggregation-bootstrap-port)."""
    if spec.engine == "sim":
        cmd = [
            sys.executable, "-m", "sim", "--host", host, "--port", str(port),
            "--metrics-endpoint", metrics_endpoint, "--page-size", str(spec.page_size),
        ]
        if spec.model:
            cmd += ["--model-name", spec.model]
        if spec.dp_size > 1:
            cmd += ["--dp-size", str(spec.dp_size)]
        if spec.kv_events_endpoint:  # the same config SGLang gets; the sim binds or connects as its --wire release
            cmd += ["--kv-events-config", json.dumps(kv_events_config(spec, host))]
        return cmd + _pd_flags(spec) + _flags({k: v for k, v in spec.engine_args.items() if k != "dp_size"}), {}
    if spec.engine == "sglang":
        cmd = [
            spec.python or sys.executable, "-m", "actors.sglang_launch", "--model-path", str(spec.model),
            "--host", host, "--port", str(port), "--page-size", str(spec.page_size), "--enable-metrics",
        ]
        # KvMetrics are only sent with --kv-events-config set (SGLang ≥ 0.5.3), even if we do not subscribe
        cmd += ["--kv-events-config", json.dumps(kv_events_config(spec, host))]
        if "enable_cache_report" not in spec.engine_args:  # usage.prompt_tokens_details.cached_tokens: the
            cmd.append("--enable-cache-report")  # router checks its predicted reuse against it
        if spec.dp_size > 1:  # DP attention is the user's choice (engine_args.enable_dp_attention)
            cmd += ["--dp-size", str(spec.dp_size)]
        env = {SGLANG_METRICS_ENV: metrics_endpoint}
        if spec.python:  # SGLang's own environment: it finds `actors.sglang_launch` in kvroute's source
            rest = spec.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, rest) if p)
        return cmd + _pd_flags(spec) + _flags({k: v for k, v in spec.engine_args.items() if k != "dp_size"}), env
    raise LaunchError(f"worker {spec.name}: no engine to launch (attach mode)")


def kv_events_config(spec: WorkerSpec, host: str) -> dict[str, Any]:
    """The `--kv-events-config` of a managed engine. With `kv_events_endpoint: auto` the worker actor
    has already BOUND its SUB on a concrete `tcp://HOST:PORT` (and put it in the spec): a concrete
    address makes every SGLang release (0.4.9 … 0.5.23) CONNECT its PUB there — no `bind` key, which
    releases before 0.5.22 ignore, and no wildcard. An explicit endpoint is passed as given."""
    endpoint = spec.kv_events_endpoint
    if endpoint in (None, "auto"):
        # no subscriber (or not placed yet): SGLang still needs the config to send KvMetrics; its
        # PUB connects to a free port nobody listens on and its batches are dropped, as intended
        endpoint = f"tcp://{host}:{free_port(host)}"
    cfg: dict[str, Any] = {"publisher": "zmq", "topic": "kv-events", "endpoint": endpoint}
    if spec.kv_events_bind is not None:
        cfg["bind"] = spec.kv_events_bind
    if spec.kv_events_replay_endpoint:
        cfg["replay_endpoint"] = spec.kv_events_replay_endpoint
    return cfg


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it (the worker actor) dies.
    Linux only; elsewhere the engine outlives a crashed actor until stopped by hand."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass(slots=True)
class ProcessStatus:
    state: str = "starting"  # starting | running | restarting | failed | stopped
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    detail: str = ""
    history: list[str] = field(default_factory=list)

    def report(self) -> ManagedEngine:
        """The status as the worker actor reports it (to the aggregator, and from `ready()`)."""
        return ManagedEngine(process=self.state, pid=self.pid, restarts=self.restarts, last_exit=self.last_exit,
                             detail=self.detail[-4000:])


class ManagedProcess:
    """Owns one engine child process for the lifetime of its worker actor. `env` is added to the
    engine's environment (the fleet entry's `env:`)."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        metrics_endpoint: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        health_timeout_s: float = 120.0,
        max_restarts: int = 5,
        restart_backoff_s: float = 0.5,
        stop_grace_s: float = 5.0,
        env: dict[str, str] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.metrics_endpoint = metrics_endpoint
        self.health_timeout_s = health_timeout_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(spec.env if env is None else env)
        self.on_change = on_change or (lambda: None)
        self.status = ProcessStatus()
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def command(self) -> tuple[list[str], dict[str, str]]:
        return build_command(self.spec, host=self.host, port=self.port, metrics_endpoint=self.metrics_endpoint)

    async def start(self) -> None:
        """Start the child and its supervisor; returns at once (see `wait_healthy`)."""
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def launch(self) -> None:
        """`start`, then `wait_healthy`; an engine that never becomes healthy is stopped again and its
        LaunchError raised."""
        await self.start()
        try:
            await self.wait_healthy()
        except LaunchError:
            await self.stop()
            raise

    async def _spawn(self) -> None:
        cmd, env_extra = self.command()
        env = {**os.environ, **self.env, **env_extra}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise LaunchError(f"worker {self.spec.name}: cannot start {cmd[0]}: {exc}") from None
        self.status.pid = self._proc.pid
        self._set("starting", f"pid {self._proc.pid}: {' '.join(cmd[:4])} …")
        logger.info("worker %s: started engine pid %d", self.spec.name, self._proc.pid)

    def _set(self, state: str, detail: str) -> None:
        self.status.state, self.status.detail = state, detail
        self.status.history = (self.status.history + [f"{time.strftime('%H:%M:%S')} {state}: {detail}"])[-20:]
        self.on_change()

    async def wait_healthy(self, progress: Callable[[str], None] | None = None) -> None:
        """Poll `/health` until 200, the engine has failed for good, or `health_timeout_s` passes.
        SGLang's /health answers after ≥ 1 s (a one-token generation), hence the per-poll timeout."""
        deadline = time.monotonic() + self.health_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if not self.alive and not self._stopping and self.status.state == "failed":
                    raise LaunchError(f"worker {self.spec.name}: engine exited ({self.status.detail})")
                try:
                    r = await client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        if self.status.state != "running":
                            self._set("running", f"pid {self.status.pid} healthy on {self.url}")
                        return
                except httpx.HTTPError:
                    pass
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaunchError(
                        f"worker {self.spec.name}: engine not healthy on {self.url}/health after {self.health_timeout_s:.0f} s"
                    )
                if progress:
                    progress(f"waiting for {self.url}/health ({left:.0f} s left)")
                await asyncio.sleep(0.1)

    async def _supervise(self) -> None:
        backoff = self.restart_backoff_s
        while not self._stopping:
            assert self._proc is not None
            code = await self._proc.wait()
            if self._stopping:
                return
            self.status.last_exit = code
            if self.status.restarts >= self.max_restarts:
                self._set("failed", f"exited with {code}; {self.max_restarts} restarts used up")
                logger.error("worker %s: engine exited (%s), not restarting", self.spec.name, code)
                return
            self.status.restarts += 1
            self._set("restarting", f"exited with {code}; restart {self.status.restarts} in {backoff:.1f} s")
            logger.warning("worker %s: engine exited with %s; restarting in %.1f s", self.spec.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            if self._stopping:
                return
            try:
                await self._spawn()
                await self.wait_healthy()
                backoff = self.restart_backoff_s
            except LaunchError as exc:
                logger.warning("%s", exc)

    async def stop(self) -> None:
        """SIGTERM the child's process group, SIGKILL after `stop_grace_s`."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait({self._supervisor}, timeout=1.0)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    await asyncio.wait_for(proc.wait(), wait)
                    break
                except asyncio.TimeoutError:
                    continue
        self._set("stopped", "stopped by kvroute")
