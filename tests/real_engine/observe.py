"""Listen to what one engine (real SGLang or the simulator) sends a router: its KvMetrics frames
(a ZMQ PULL bound at the engine's metrics address, decoded by kvroute's own `actors.wire`) and its
KV-event batches (a ZMQ SUB bound at the concrete tcp:// address the engine's publisher connects
to, decoded by `sim.kv_events.decode_batch`, which reads both encodings), each with its arrival time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from actors.wire import decode_kv_metrics
from sim.kv_events import decode_batch


@dataclass
class Frame:
    t: float
    kind: str  # "metrics" | "kv"
    body: Any
    seq: int | None = None


@dataclass
class Observer:
    metrics_endpoint: str
    kv_endpoint: str
    frames: list[Frame] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.metrics_endpoint)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(self.kv_endpoint)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                now = time.monotonic()
                try:
                    if sock is self._pull:
                        f = Frame(now, "metrics", decode_kv_metrics(sock.recv()))
                    else:
                        parts = sock.recv_multipart()
                        ts, events, rank = decode_batch(parts[-1])
                        f = Frame(now, "kv", (ts, events, rank), seq=int.from_bytes(parts[1], "big"))
                except Exception as exc:  # a frame kvroute could not read is a finding, not noise
                    self.errors.append(repr(exc))
                    continue
                with self._lock:
                    self.frames.append(f)

    def mark(self) -> int:
        with self._lock:
            return len(self.frames)

    def since(self, mark: int, kind: str | None = None) -> list[Frame]:
        with self._lock:
            out = self.frames[mark:]
        return [f for f in out if kind is None or f.kind == kind]

    def wait_for(self, pred, timeout_s: float = 10.0, mark: int = 0) -> list[Frame]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.since(mark)
            if pred(got):
                return got
            time.sleep(0.02)
        raise TimeoutError(f"observer: condition not met within {timeout_s} s; frames: {self.since(mark)[-10:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pull.close(0)
        self._sub.close(0)
        self._ctx.term()
