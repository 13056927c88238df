"""Publishes KV event batches like SGLang's ZmqEventPublisher: a bound PUB plus optional replay.

Frames: `[topic, seq (8-byte big-endian, 0, 1, 2 … per batch), msgpack batch]`. The last
`buffer_steps` batches are kept; a ROUTER on the replay endpoint answers
`[identity, b"", start_seq (8 bytes)]` with every buffered batch whose seq ≥ start_seq, each as
`[identity, b"", topic, seq, payload]`, then `[identity, b"", b"", seq = -1, b""]`.
PUB never blocks: at the high-water mark ZMQ drops, and subscribers see a gap in `seq`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

import zmq

from sim.kv_events import Encoding, KvEvent, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        encoding: Encoding = "map",
        topic: str = "",
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        self.encoding = encoding
        self.dp_rank = dp_rank
        self._topic = topic.encode("utf-8")
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind KV event socket ({endpoint}, replay {replay_endpoint}): {exc}") from exc

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> int:
        """Encode and send one batch; returns its seq."""
        payload = encode_batch(time.time() if ts is None else ts, events, self.dp_rank, self.encoding)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("KV event batch %d dropped at the PUB high-water mark", seq)
        self._buffer.append((seq, payload))
        return seq

    def serve_replay(self) -> int:
        """Answer every pending replay request without blocking; returns how many were served."""
        if self._replay is None or self._replay.closed:
            return 0
        served = 0
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
            served += 1
        return served

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
