"""Publishes KV event batches like SGLang's ZmqEventPublisher of one release: a PUB plus optional replay.

Frames: `[topic, seq (8-byte big-endian, 0, 1, 2 … per batch), msgpack batch]`. Whether the PUB
binds or connects follows the release's own rule (`pub_binds`), so a subscriber that gets the
direction wrong hears nothing — as with real SGLang. The last `buffer_steps` batches are kept; a
ROUTER (always bound) on the replay endpoint answers `[identity, b"", start_seq (8 bytes)]` with
every buffered batch whose seq ≥ start_seq, then an end marker, in the release's form:
`[identity, b"", seq, payload]` … `[identity, b"", -1, b""]` up to 0.5.21,
`[identity, b"", topic, seq, payload]` … `[identity, b"", b"", -1, b""]` from 0.5.22.
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


def _release(release: str) -> tuple[int, int, int]:
    major, minor, patch = (release.split("-")[0].split(".") + ["0", "0"])[:3]
    return int(major), int(minor), int(patch)


def pub_binds(endpoint: str, bind: bool | None, release: str) -> bool:
    """SGLang `release`'s ZmqEventPublisher rule (sglang/srt/disaggregation/kv_events.py): the
    config's `bind` from 0.5.22 (earlier releases drop the key); else bind when the endpoint
    contains "*" or "::" (substring), from 0.5.14 also "0.0.0.0", or is ipc:// / inproc://."""
    rel = _release(release)
    if bind is not None and rel >= (0, 5, 22):
        return bind
    return (
        "*" in endpoint
        or "::" in endpoint
        or (rel >= (0, 5, 14) and "0.0.0.0" in endpoint)
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """SGLang's per-rank endpoint: tcp port + rank, inproc suffix, anything else refused for rank > 0."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


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
        release: str = "0.5.23",
        bind: bool | None = None,
    ) -> None:
        self.encoding = encoding
        self.dp_rank = dp_rank
        self.release = release
        self._replay_has_topic = _release(release) >= (0, 5, 22)
        endpoint = offset_endpoint(endpoint, dp_rank) or endpoint
        replay_endpoint = offset_endpoint(replay_endpoint, dp_rank)
        self.binds = pub_binds(endpoint, bind, release)
        self._topic = topic.encode("utf-8")
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            if self.binds:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:  # a concrete tcp address: SGLang connects, the subscriber must bind
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            verb = "bind" if self.binds else "connect"
            raise ValueError(f"cannot {verb} KV event socket ({endpoint}, replay {replay_endpoint}): {exc}") from exc

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
            head = (self._topic,) if self._replay_has_topic else ()
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", *head, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", *(b"",) * len(head), END_SEQ, b""))
            served += 1
        return served

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
