"""actors.wire.kv_events: both SGLang KV-event encodings decode; gaps are seen; garbage is refused.

The frames are built with msgspec Structs declared exactly like SGLang's own (0.4.9/0.5.12: tagged
arrays; 0.5.23: tagged maps), encoded by the same `msgspec.msgpack.Encoder` the publisher uses.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Union

import msgspec
import pytest

from actors.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    SeqTracker,
    decode_kv_event_frame,
    is_replay_end,
)


# -- SGLang 0.5.12 (same layout as 0.4.9 … 0.5.18, plus `medium`) --------------------------
class EventBatch512(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class Ev512(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored512(Ev512, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class BlockRemoved512(Ev512, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared512(Ev512, tag="AllBlocksCleared"):
    pass


class KVEventBatch512(EventBatch512):
    events: list[Union[BlockStored512, BlockRemoved512, AllBlocksCleared512]]


# -- SGLang 0.5.23 (tagged maps, from 0.5.20) ------------------------------------------------
class EventBatch523(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class Ev523(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored523(Ev523, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved523(Ev523, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared523(Ev523, tag="AllBlocksCleared"):
    pass


class KVEventBatch523(EventBatch523):
    events: list[Union[BlockStored523, BlockRemoved523, AllBlocksCleared523]]


ENC = msgspec.msgpack.Encoder()


def frame(batch: Any, seq: int = 7, topic: bytes = b"") -> list[bytes]:
    payload = batch if isinstance(batch, bytes) else ENC.encode(batch)
    return [topic, seq.to_bytes(8, "big"), payload]


def test_tagged_array_events_of_0_5_12_decode_with_their_fields():
    parent = -(2**63) + 5
    batch = KVEventBatch512(ts=1.5, events=[
        BlockStored512([11, 12], parent, list(range(32)), 16, None, "GPU"),
        BlockStored512([13], None, [1] * 16, 16, None),  # medium omitted (default)
        BlockRemoved512([11]),
        AllBlocksCleared512(),
    ], attn_dp_rank=None)
    raw = ENC.encode(batch)
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # really the array form
    b = decode_kv_event_frame(frame(raw, seq=42, topic=b"kv"))
    assert (b.seq, b.topic, b.ts, b.dp_rank, b.skipped) == (42, b"kv", 1.5, 0, 0)
    assert b.events == (
        BlockStored((11, 12), parent, tuple(range(32)), 16, None, "GPU"),
        BlockStored((13,), None, (1,) * 16, 16, None, None),
        BlockRemoved((11,), None),
        AllBlocksCleared(),
    )


def test_tagged_map_events_of_0_5_23_decode_ignoring_new_keys():
    batch = KVEventBatch523(ts=2.0, events=[
        BlockStored523([21], 20, [5] * 16, 16, None, "GPU", cache_salt="s", session_id="x", lora_name="a"),
        BlockRemoved523([21], "GPU"),
        AllBlocksCleared523(),
    ], attn_dp_rank=3)
    raw = ENC.encode(batch)
    assert msgspec.msgpack.decode(raw)[1][0]["type"] == "BlockStored"  # really the map form
    b = decode_kv_event_frame(frame(raw))
    assert b.dp_rank == 3
    assert b.events == (
        BlockStored((21,), 20, (5,) * 16, 16, None, "GPU", "a"),  # lora_name read: the adapter's namespace
        BlockRemoved((21,), "GPU"),
        AllBlocksCleared(),
    )


def test_unknown_event_types_and_extra_fields_are_skipped_not_fatal():
    raw = ENC.encode([1.0, [
        ["BlockStored", [1], None, [0] * 4, 4, None, "GPU", "future-field"],
        ["SomethingNew", 1, 2],
        {"type": "AlsoNew"},
        {"type": "BlockRemoved", "block_hashes": [1], "future": True},
    ], 0, "extra batch field"])
    b = decode_kv_event_frame(frame(raw))
    assert b.skipped == 2
    assert b.events == (BlockStored((1,), None, (0,) * 4, 4, None, "GPU"), BlockRemoved((1,), None))


@pytest.mark.parametrize("frames, reason", [
    ([b"", b"\x00" * 8], "bad_frames"),
    ([b"", b"\x00" * 4, ENC.encode([1.0, []])], "bad_seq"),
    ([b"t" * 300, b"\x00" * 8, ENC.encode([1.0, []])], "bad_topic"),
    (frame(b"\xc1"), "bad_msgpack"),  # 0xc1 is never valid msgpack
    (frame(pickle.dumps(("os", "system"))), "bad_msgpack"),
    (frame(ENC.encode({"ts": 1})), "bad_batch"),
    (frame(ENC.encode([float("nan"), []])), "bad_batch"),
    (frame(ENC.encode([1.0, {}])), "bad_batch"),
    (frame(ENC.encode([1.0, [], -1])), "bad_batch"),
    (frame(ENC.encode([1.0, [["BlockStored", [1]]]])), "bad_event"),
    (frame(ENC.encode([1.0, [["BlockStored", ["x"], None, [], 16, None]]])), "bad_event"),
    (frame(ENC.encode([1.0, [["BlockStored", [1.5], None, [], 16, None]]])), "bad_event"),
    (frame(ENC.encode([1.0, [["BlockStored", [1], None, ["a"], 16, None]]])), "bad_event"),
    (frame(ENC.encode([1.0, [["BlockStored", [1], None, [1], 0, None]]])), "bad_event"),
    (frame(ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])), "bad_event"),
    (frame(ENC.encode([1.0, [{"kind": "BlockStored"}]])), "bad_event"),
    (frame(ENC.encode([1.0, [42]])), "bad_event"),
    (frame(ENC.encode([1.0, [msgspec.msgpack.Ext(1, b"x")]])), "bad_event"),
])
def test_malformed_frames_are_refused_with_a_reason(frames, reason):
    with pytest.raises(KvEventError) as e:
        decode_kv_event_frame(frames)
    assert isinstance(e.value, ValueError)
    assert e.value.reason == reason


def test_oversized_payloads_are_refused_before_decoding():
    raw = ENC.encode([1.0, [["BlockRemoved", list(range(1000))]]])
    with pytest.raises(KvEventError, match="too_large"):
        decode_kv_event_frame(frame(raw), max_payload_bytes=100)


def test_replay_end_marker_is_recognised_not_decoded():
    end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert is_replay_end(end)
    assert not is_replay_end(frame(ENC.encode([1.0, []])))
    with pytest.raises(KvEventError, match="replay_end"):
        decode_kv_event_frame(end)


def test_seq_tracker_reports_gaps_duplicates_and_restarts():
    t = SeqTracker()
    assert t.observe(10).kind == "first"
    assert t.observe(11).kind == "ok"
    gap = t.observe(15)
    assert (gap.kind, gap.missing_from, gap.missing_to) == ("gap", 12, 14)
    assert gap.lost_state and gap.apply
    assert t.gaps == 1 and t.missed == 3
    dup = t.observe(15)
    assert dup.kind == "duplicate" and not dup.apply
    restart = t.observe(0)
    assert restart.kind == "restart" and restart.lost_state
    assert t.observe(1).kind == "ok"
