"""Launching and supervising a worker's engine process (managed mode): `sim` or real `sglang`.

Pure asyncio + subprocess (no Ray): the worker's owner (its actor, or its node's host) holds one
`ManagedProcess`. It starts the engine under a keeper (`actors.keeper`: own process group, stopped
when its owner has been gone `orphan_grace_s`), waits for `/health`, restarts it with backoff when it
dies (bounded), stops it with SIGTERM then SIGKILL after a grace period, and can adopt the engine of
a previous incarnation of its owner — no orphans.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from actors.fleet import WorkerSpec
from actors.protocol import ManagedEngine

logger = logging.getLogger("kvroute.launcher")

SGLANG_METRICS_ENV = "KVROUTE_METRICS_IPC_NAME"


class LaunchError(RuntimeError):
    """The engine process could not be started or never became healthy."""


# Ports for managed engines (HTTP) and the KV-event sockets kvroute places, picked outside the
# kernel's ephemeral range (32768-60999 by default): a port-0 pick there can be taken as the source
# port of any outgoing connection (Ray's gRPC clients open many at start) before the engine binds
# it — the engine then fails with "address already in use" on every restart. Below the HAProxy
# (20000-27999) and Serve direct-ingress (28000-29999) ranges of serve_app.ray_env.
PORT_RANGE = (12000, 19999)


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None, count: int = 1) -> int:
    """A TCP port in `PORT_RANGE` that was free on `host` a moment ago — with `count` > 1, the first of
    `count` consecutive ones (SGLang offsets a DP rank's ports by its rank)."""
    rng = rng or random.Random()
    lo, hi = PORT_RANGE
    for _ in range(200):
        port = rng.randint(lo, hi - count + 1)
        if all(_bindable(host, port + k) for k in range(count)):
            return port
    raise LaunchError(f"no {count} consecutive free port(s) on {host} in {lo}-{hi}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


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
            sys.executable, "-m", "actors.sglang_launch", "--model-path", str(spec.model),
            "--host", host, "--port", str(port), "--page-size", str(spec.page_size), "--enable-metrics",
        ]
        # KvMetrics are only sent with --kv-events-config set (SGLang ≥ 0.5.3), even if we do not subscribe
        cmd += ["--kv-events-config", json.dumps(kv_events_config(spec, host))]
        if spec.dp_size > 1:  # DP attention is the user's choice (engine_args.enable_dp_attention)
            cmd += ["--dp-size", str(spec.dp_size)]
        return cmd + _pd_flags(spec) + _flags({k: v for k, v in spec.engine_args.items() if k != "dp_size"}), \
            {SGLANG_METRICS_ENV: metrics_endpoint}
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


def _unlink_if_stale(path: str) -> None:
    """Remove `path` if it is a Unix socket nobody listens on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)
            except OSError:
                pass
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
    """Owns one engine for the lifetime of its worker (its actor, or the host that hosts it): the
    engine runs under an `actors.keeper` process, which this object talks to over a Unix socket
    (`control`). `orphan_grace_s` > 0 lets the engine outlive this object's process that long, so
    that a restarted owner that remembers `control` adopts it (`start()` connects instead of
    launching); 0 stops it as soon as the owner is gone."""

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
        orphan_grace_s: float = 0.0,
        control: str | None = None,
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
        self.orphan_grace_s = orphan_grace_s
        self.env = dict(env or {})  # added to the engine's environment (its reserved GPUs)
        self.control = control  # the keeper's socket: given, an engine to adopt; else set by each launch
        self.adopted = False
        self.on_change = on_change or (lambda: None)
        self.status = ProcessStatus()
        self._keeper_pid: int | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._running = False
        self._stopping = False
        self._supervisor: asyncio.Task | None = None
        self._healthy = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self._running

    def command(self) -> tuple[list[str], dict[str, str]]:
        return build_command(self.spec, host=self.host, port=self.port, metrics_endpoint=self.metrics_endpoint)

    async def start(self) -> None:
        """Adopt the engine of `control` if its keeper still runs, else launch one; start the
        supervisor. Returns at once (see `wait_healthy`)."""
        if not (self.control and await self._adopt()):
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

    async def _adopt(self) -> bool:
        assert self.control is not None
        try:
            await self._connect(self.control, timeout_s=1.0)
        except LaunchError as exc:
            logger.info("worker %s: no engine to adopt (%s); launching one", self.spec.name, exc)
            _unlink_if_stale(self.control)  # a keeper killed with SIGKILL leaves its socket file behind
            return False
        self.adopted = True
        self._set("starting", f"adopted engine pid {self.status.pid} (keeper {self.control})")
        logger.info("worker %s: adopted engine pid %s on %s", self.spec.name, self.status.pid, self.url)
        return True

    async def _spawn(self) -> None:
        from actors.keeper import control_dir

        cmd, env_extra = self.command()
        env = {**os.environ, **self.env, **env_extra}
        self.control = os.path.join(control_dir(), f"{self.spec.name}-{os.urandom(4).hex()}.ctl")
        keeper = [sys.executable, "-m", "actors.keeper", "--control", self.control,
                  "--grace-s", str(self.orphan_grace_s), "--stop-grace-s", str(self.stop_grace_s), "--", *cmd]
        try:
            launcher = await asyncio.create_subprocess_exec(
                *keeper, env=env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"worker {self.spec.name}: cannot start {sys.executable}: {exc}") from None
        # it returns once the (detached) keeper runs the engine
        code = await launcher.wait()
        if code != 0:
            raise LaunchError(f"worker {self.spec.name}: cannot start its engine {cmd[:4]} (keeper exit {code}; "
                              "see this actor's log)")
        self._healthy.clear()
        await self._connect(self.control, timeout_s=30.0)
        self._set("starting", f"pid {self.status.pid}: {' '.join(cmd[:4])} …")
        logger.info("worker %s: started engine pid %d", self.spec.name, self.status.pid)

    async def _connect(self, path: str, timeout_s: float) -> None:
        """Connect to the keeper at `path` and read the engine's pid; LaunchError if that fails in time."""
        deadline = time.monotonic() + timeout_s
        last = "no keeper socket"
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
                line = await asyncio.wait_for(reader.readline(), max(0.1, deadline - time.monotonic()))
                hello = json.loads(line)
                pid, keeper = int(hello["pid"]), int(hello["keeper"])
                break
            except (OSError, ValueError, KeyError, TypeError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise LaunchError(f"worker {self.spec.name}: cannot reach the engine's keeper at {path} ({last})")
            await asyncio.sleep(0.02)
        self._reader, self._writer = reader, writer
        self._running = True
        self.status.pid, self._keeper_pid = pid, keeper

    async def _wait_exit(self) -> int | None:
        """The engine's exit code, as its keeper tells it (None: the keeper itself died, and the
        engine with it)."""
        assert self._reader is not None
        code: int | None = None
        try:
            while line := await self._reader.readline():
                try:
                    code = int(json.loads(line)["exit"])
                    break
                except (ValueError, KeyError, TypeError):
                    continue
        except (ConnectionError, OSError):
            pass
        self._running = False
        if self._writer is not None:
            self._writer.close()
        return code

    def _set(self, state: str, detail: str) -> None:
        self.status.state, self.status.detail = state, detail
        self.status.history = (self.status.history + [f"{time.strftime('%H:%M:%S')} {state}: {detail}"])[-20:]
        self.on_change()

    async def wait_healthy(self, progress: Callable[[str], None] | None = None) -> None:
        """Poll `/health` until 200, the engine has failed for good, or `health_timeout_s` passes."""
        deadline = time.monotonic() + self.health_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self._running and not self._stopping and self.status.state == "failed":
                    raise LaunchError(f"worker {self.spec.name}: engine exited ({self.status.detail})")
                try:
                    r = await client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        self._healthy.set()
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
            code = await self._wait_exit()
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
        """Stop the engine: its keeper sends SIGTERM to its process group, SIGKILL after
        `stop_grace_s`; if the keeper does not answer, SIGKILL to the engine's group and the keeper."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait({self._supervisor}, timeout=1.0)
        if self._running and self._writer is not None:
            try:
                self._writer.write(b"stop\n")
                await self._writer.drain()
                await asyncio.wait_for(self._wait_exit(), self.stop_grace_s + 6.0)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                for pid in (self.status.pid, self._keeper_pid):
                    if pid:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                self._running = False
        self._set("stopped", "stopped by kvroute")
