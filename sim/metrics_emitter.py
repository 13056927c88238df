"""Sends KvMetrics frames the way SGLang's scheduler does: a ZMQ PUSH that connects, never binds.

Frames are the exact bytes of the chosen release (`sim.sglang_shapes.encode_kv_metrics`).
Sends never block the engine: with no receiver connected (or a full pipe) a frame is dropped
and counted, as a PUSH at its high-water mark would lose it.
"""

from __future__ import annotations

import logging

import zmq

from sim.engine import KvReport
from sim.sglang_shapes import WIRE_FORMS, encode_kv_metrics

logger = logging.getLogger(__name__)


class MetricsEmitter:
    """PUSH-connects to `endpoint`; `send(report)` encodes with `wire` and sends without blocking."""

    def __init__(self, endpoint: str, wire: str, *, context: zmq.Context | None = None) -> None:
        if wire not in WIRE_FORMS:
            raise ValueError(f"unknown wire form {wire!r}: expected one of {sorted(WIRE_FORMS)}")
        self.endpoint = endpoint
        self.wire = wire
        self.sent = 0
        self.dropped = 0
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ValueError(f"metrics endpoint {endpoint!r} is not a ZMQ address: {exc}") from exc

    def send(self, report: KvReport) -> bool:
        """Send one report; False if it was dropped (nobody listening or pipe full)."""
        if self._sock.closed:
            return False
        frame = encode_kv_metrics(self.wire, **report.as_dict())
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.debug("metrics to %s dropped (%d so far): no receiver", self.endpoint, self.dropped)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
