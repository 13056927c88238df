"""SGLang KV-event frames → typed events, executing nothing; plus sequence-gap tracking per publisher.

A publisher (`--kv-events-config`, one ZMQ PUB per attention-DP rank) sends multipart frames
`[topic, seq (8-byte big-endian, +1 per batch from 0), msgpack(batch)]`, batch = `[ts, [events…],
attn_dp_rank]` (a positional array; releases ≤ 0.5.12 omit a None rank). Events come in two
encodings, both accepted (checked against the released sources of 0.4.9, 0.5.8, 0.5.12, 0.5.23):

- tagged arrays up to 0.5.18 (msgspec `array_like=True, tag=True, omit_defaults=True`):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?]`,
  `["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`;
- tagged maps from 0.5.20: `{"type": "BlockStored", "block_hashes": …, …}` with optional keys
  (`medium`, `cache_salt`, `session_id`, `lora_name`) omitted when None.

Unknown keys, extra trailing fields and unknown event types are ignored (forward compatible);
anything structurally wrong refuses the whole frame with `KvEventError`. msgpack is data only, and
sizes are bounded before and while decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import msgspec

DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
MAX_TOPIC_BYTES = 256
MAX_EVENTS_PER_BATCH = 65_536
MAX_HASHES_PER_EVENT = 65_536
MAX_TOKENS_PER_EVENT = 1 << 20
REPLAY_END_SEQ = (1 << 64) - 1  # the replay ROUTER's end marker: (-1).to_bytes(8, "big", signed=True)
_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1


class KvEventError(ValueError):
    """A KV-event frame was refused. `reason` is a short machine-readable tag for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks cached by the engine: `block_hashes[k]` covers `token_ids[k·block_size:(k+1)·block_size]`;
    the first one's parent is `parent_block_hash` (None at the root)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[Any, ...]  # ints (bigram models: 2-int tuples)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # the LoRA adapter whose cache namespace they are in (map form, 0.5.23)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    topic: bytes
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int  # attention-DP rank (0 when absent)
    skipped: int = 0  # events of unknown type, ignored


_decoder = msgspec.msgpack.Decoder()


def decode_kv_event_frame(
    frames: Sequence[bytes], *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> KvEventBatch:
    """One multipart message `[topic, seq, payload]` → `KvEventBatch`. Raises `KvEventError`."""
    if not isinstance(frames, (list, tuple)) or len(frames) != 3:
        n = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise KvEventError("bad_frames", f"expected 3 frames [topic, seq, payload], got {n}")
    topic, seq_b, payload = (bytes(f) for f in frames)
    if len(topic) > MAX_TOPIC_BYTES:
        raise KvEventError("bad_topic", f"topic of {len(topic)} bytes (max {MAX_TOPIC_BYTES})")
    if len(seq_b) != 8:
        raise KvEventError("bad_seq", f"sequence frame of {len(seq_b)} bytes, expected 8")
    seq = int.from_bytes(seq_b, "big")
    if seq == REPLAY_END_SEQ:
        raise KvEventError("replay_end", "replay end marker, not a batch (see is_replay_end)")
    if len(payload) > max_payload_bytes:
        raise KvEventError("too_large", f"payload of {len(payload)} bytes (max {max_payload_bytes})")
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise KvEventError("bad_msgpack", str(e)) from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 8:
        raise KvEventError("bad_batch", "batch must be an array [ts, events, attn_dp_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise KvEventError("bad_batch", f"ts must be a finite number, got {ts!r:.40}")
    if not isinstance(raw_events, list):
        raise KvEventError("bad_batch", "events must be an array")
    if len(raw_events) > MAX_EVENTS_PER_BATCH:
        raise KvEventError("too_large", f"{len(raw_events)} events in one batch (max {MAX_EVENTS_PER_BATCH})")
    if rank is None:
        rank = 0
    elif type(rank) is not int or not 0 <= rank < 1 << 16:
        raise KvEventError("bad_batch", f"attn_dp_rank must be a small non-negative int, got {rank!r:.40}")
    events: list[KvEvent] = []
    skipped = 0
    for i, raw in enumerate(raw_events):
        ev = _event(raw, i)
        if ev is None:
            skipped += 1
        else:
            events.append(ev)
    return KvEventBatch(topic, seq, float(ts), tuple(events), rank, skipped)


def is_replay_end(frames: Sequence[bytes]) -> bool:
    """True for the replay socket's end marker `[b"", (-1 as 8 bytes), b""]`."""
    return len(frames) == 3 and bytes(frames[1]) == REPLAY_END_SEQ.to_bytes(8, "big")


def replay_reply(frames: Sequence[bytes], topic: bytes = b"") -> list[bytes] | None:
    """One reply of a replay ROUTER, as a DEALER receives it, → `[topic, seq, payload]` for
    `decode_kv_event_frame`, or None for the end marker. Both release forms are accepted:
    `[b"", seq, payload]` / end `[b"", -1, b""]` up to 0.5.21, and `[b"", topic, seq, payload]` /
    end `[b"", b"", -1, b""]` from 0.5.22 (`topic`: what to report for the older form).
    Raises `KvEventError` for anything else."""
    parts = [bytes(f) for f in frames]
    if parts and parts[0] == b"":
        parts = parts[1:]  # the DEALER/REQ delimiter
    end = REPLAY_END_SEQ.to_bytes(8, "big")
    if len(parts) == 2:
        return None if parts[0] == end else [topic, parts[0], parts[1]]
    if len(parts) == 3:
        return None if parts[1] == end else parts
    raise KvEventError("bad_replay", f"replay reply of {len(parts)} frames, expected 2 or 3")


# field order of the tagged-array encoding (after the tag), as the released Structs declare them
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_REQUIRED = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}
# keys a map event must carry (SGLang always writes them; None-valued optional ones are omitted)
_MAP_REQUIRED = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event(raw: Any, i: int) -> KvEvent | None:
    where = f"event {i}"
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KvEventError("bad_event", f"{where}: array event without a type tag")
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag)
        if names is None:
            return None
        if len(raw) - 1 < _REQUIRED[tag]:
            raise KvEventError("bad_event", f"{where}: {tag} has {len(raw) - 1} fields, needs {_REQUIRED[tag]}")
        fields = dict(zip(names, raw[1:]))  # extra trailing fields are ignored
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventError("bad_event", f"{where}: map event without a string 'type'")
        if tag not in _ARRAY_FIELDS:
            return None
        fields = raw
        for name in _MAP_REQUIRED[tag]:
            if name not in fields:
                raise KvEventError("bad_event", f"{where}: {tag} lacks {name!r}")
    else:
        raise KvEventError("bad_event", f"{where}: neither an array nor a map")
    where = f"{where} ({tag})"
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields.get("block_hashes"), where)
    medium = _opt_str(fields.get("medium"), f"{where}.medium")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise KvEventError("bad_event", f"{where}.parent_block_hash: not a 64-bit integer")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS_PER_EVENT:
        raise KvEventError("bad_event", f"{where}.token_ids: must be an array of ≤ {MAX_TOKENS_PER_EVENT}")
    if not all(type(t) is int for t in tokens):
        if all(isinstance(t, list) and len(t) == 2 and type(t[0]) is int and type(t[1]) is int
               for t in tokens):
            tokens = [tuple(t) for t in tokens]  # bigram pages expose token pairs
        else:
            raise KvEventError("bad_event", f"{where}.token_ids: must be integers")
    bs = fields.get("block_size")
    if type(bs) is not int or not 1 <= bs <= 1 << 20:
        raise KvEventError("bad_event", f"{where}.block_size: must be a positive integer, got {bs!r:.40}")
    lora = fields.get("lora_id")
    if lora is not None and type(lora) is not int:
        raise KvEventError("bad_event", f"{where}.lora_id: must be an integer or null")
    lora_name = _opt_str(fields.get("lora_name"), f"{where}.lora_name")
    if lora_name is not None and len(lora_name) > 256:
        raise KvEventError("bad_event", f"{where}.lora_name: longer than 256 characters")
    return BlockStored(hashes, parent, tuple(tokens), bs, lora, medium, lora_name)


def _is_hash(x: Any) -> bool:
    return type(x) is int and _I64_MIN <= x <= _U64_MAX


def _hashes(x: Any, where: str) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > MAX_HASHES_PER_EVENT:
        raise KvEventError("bad_event", f"{where}.block_hashes: must be an array of ≤ {MAX_HASHES_PER_EVENT}")
    if not all(_is_hash(h) for h in x):
        raise KvEventError("bad_event", f"{where}.block_hashes: must be 64-bit integers")
    return tuple(x)


def _opt_str(x: Any, where: str) -> str | None:
    if x is None or isinstance(x, str):
        return x
    raise KvEventError("bad_event", f"{where}: must be a string or null")


@dataclass(frozen=True, slots=True)
class SeqStatus:
    """What one sequence number means for the publisher's stream.

    kind: `first` (nothing seen before: state before it is unknown), `ok` (next in order),
    `gap` (batches `missing_from`..`missing_to` were lost: resync via replay from `missing_from`,
    or drop this publisher's entries), `duplicate` (already applied: ignore the batch),
    `restart` (sequence went back to the start: the engine restarted, its cache is empty).
    """

    kind: str
    missing_from: int = 0
    missing_to: int = 0

    @property
    def apply(self) -> bool:
        """Whether the batch carrying this seq should be applied to the index."""
        return self.kind != "duplicate"

    @property
    def lost_state(self) -> bool:
        """Whether the index's entries for this publisher can no longer be trusted."""
        return self.kind in ("gap", "restart")


class SeqTracker:
    """Per-publisher sequence check: feed each batch's `seq`, act on the returned `SeqStatus`.

    A seq lower than the last one is a restart when it is at most `restart_below` (publishers count
    from 0), otherwise a duplicate (e.g. overlap of a replay with the live stream).
    """

    __slots__ = ("last", "restart_below", "gaps", "missed")

    def __init__(self, restart_below: int = 16) -> None:
        self.last: int | None = None
        self.restart_below = restart_below
        self.gaps = 0  # counters for /metrics
        self.missed = 0

    def observe(self, seq: int) -> SeqStatus:
        last = self.last
        if last is None:
            self.last = seq
            return SeqStatus("first")
        if seq == last + 1:
            self.last = seq
            return SeqStatus("ok")
        if seq > last + 1:
            self.last = seq
            self.gaps += 1
            self.missed += seq - last - 1
            return SeqStatus("gap", last + 1, seq - 1)
        if seq <= self.restart_below and seq < last:
            self.last = seq
            return SeqStatus("restart")
        return SeqStatus("duplicate")

    def reset(self) -> None:
        """Forget the position (after a resync that restarts the stream)."""
        self.last = None
