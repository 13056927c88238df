"""KV events: SGLang's block hashes, both msgpack encodings, and the PUB/replay sockets."""

from __future__ import annotations

import hashlib
import struct
import uuid

import msgspec
import pytest
import zmq

from sim.config import EngineConfig
from sim.engine import Engine, run_until_idle
from sim.kv_event_publisher import END_SEQ, KvEventPublisher, offset_endpoint, pub_binds
from sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    decode_batch,
    encode_batch,
    event_hash,
    page_digest,
)


def _sglang_reference_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """SGLang's algorithm written out independently: sha256 chain over 4-byte LE ids, int64 of hex[:16]."""
    out, prior = [], None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in token_ids[start : start + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


def test_block_hashes_match_sglangs_chained_sha256():
    ids = [7, 128000, 42, 99999, 3, 1, 4, 1, 5, 9, 2, 6, 5]
    assert block_hashes(ids, 4) == _sglang_reference_hashes(ids, 4)
    assert len(block_hashes(ids, 4)) == 3  # the trailing partial page has no hash


def test_block_hash_depends_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second page, different parent
    d = page_digest(None, [1, 2, 3, 4])
    assert event_hash(page_digest(d, [5, 6, 7, 8])) == a[1]
    assert event_hash(d) == struct.unpack(">q", hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()[:8])[0]


EVENTS = [
    BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[1, 2], block_size=2),
    BlockStored(block_hashes=[12], parent_block_hash=11, token_ids=[3, 4], block_size=2),
    BlockRemoved(block_hashes=[5]),
    BlockRemoved(block_hashes=[6]),
    AllBlocksCleared(),
]


def test_array_encoding_is_tagged_arrays_one_event_per_page():
    raw = msgspec.msgpack.decode(encode_batch(1.5, EVENTS, 3, "array"))
    assert raw[0] == 1.5 and raw[2] == 3
    assert raw[1] == [
        ["BlockStored", [11], None, [1, 2], 2, None, "GPU"],
        ["BlockStored", [12], 11, [3, 4], 2, None, "GPU"],
        ["BlockRemoved", [5], "GPU"],
        ["BlockRemoved", [6], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_map_encoding_is_tagged_maps_with_chains_and_removals_merged():
    raw = msgspec.msgpack.decode(encode_batch(2.0, EVENTS, 0, "map"))
    assert raw[0] == 2.0 and raw[2] == 0
    assert raw[1] == [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [5, 6], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_encoding_does_not_mutate_the_callers_events():
    events = [BlockStored([1], None, [1], 1), BlockStored([2], 1, [2], 1)]
    encode_batch(0.0, events, 0, "map")
    assert events[0].block_hashes == [1] and events[0].token_ids == [1]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_decode_batch_reads_both_encodings(encoding):
    ts, events, rank = decode_batch(encode_batch(3.0, EVENTS, 1, encoding))
    assert (ts, rank) == (3.0, 1)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert [h for e in stored for h in e.block_hashes] == [11, 12]
    assert removed == [5, 6]
    assert isinstance(events[-1], AllBlocksCleared)


def test_decode_batch_skips_unknown_event_types_and_keys():
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "Future", "x": 1}, {"type": "BlockRemoved", "block_hashes": [9], "new_key": 2}], 0]
    )
    _, events, _ = decode_batch(payload)
    assert events == [BlockRemoved(block_hashes=[9], medium=None)]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_engine_store_and_evict_events_round_trip_in_both_encodings(encoding):
    batches: list[bytes] = []

    class Listener:
        def on_kv_metrics(self, report):
            pass

        def on_kv_events(self, events):
            batches.append(encode_batch(0.0, events, 0, encoding))

    engine = Engine(EngineConfig(page_size=4, max_total_num_tokens=16, record_kv_events=True), Listener())
    t = [0.0]
    first = list(range(100, 116))  # fills all 4 pages
    engine.submit("a", first, 1, 0.0)
    run_until_idle(engine, lambda: t[0], lambda d: t.__setitem__(0, t[0] + d))
    engine.submit("b", list(range(500, 508)), 1, t[0])  # 2 pages: evicts a's last 2
    run_until_idle(engine, lambda: t[0], lambda d: t.__setitem__(0, t[0] + d))
    events = [e for b in batches for e in decode_batch(b)[1]]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored == block_hashes(first, 4) + block_hashes(list(range(500, 508)), 4)
    assert sorted(removed) == sorted(block_hashes(first, 4)[2:])


# ------------------------------------------------------------------ sockets


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _recv(sock: zmq.Socket, timeout_ms: int = 2000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def test_publisher_sends_three_frames_with_increasing_sequence(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}"
    pub = KvEventPublisher(endpoint, encoding="map", topic="kv", context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    # PUB drops until the subscription has propagated: publish until the first frame arrives
    for _ in range(200):
        pub.publish([BlockRemoved([1])], ts=1.0)
        if sub.poll(10):
            break
    first = sub.recv_multipart()
    while sub.poll(50):
        first = sub.recv_multipart()  # drain to the newest
    seq0 = int.from_bytes(first[1], "big")
    pub.publish(EVENTS, ts=9.0)
    topic, seq, payload = _recv(sub)
    assert topic == b"kv"
    assert len(seq) == 8 and int.from_bytes(seq, "big") == seq0 + 1
    ts, events, rank = decode_batch(payload)
    assert (ts, rank) == (9.0, 0) and isinstance(events[-1], AllBlocksCleared)
    pub.close()


def test_replay_returns_buffered_batches_from_a_sequence_then_the_end_marker(ctx, tmp_path):
    pub = KvEventPublisher(
        f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay", encoding="array", context=ctx
    )
    for i in range(5):
        pub.publish([BlockRemoved([i])], ts=float(i))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (3).to_bytes(8, "big")])
    served = 0
    for _ in range(200):
        served += pub.serve_replay()
        if served:
            break
        dealer.poll(10)
    assert served == 1
    replies = [_recv(dealer) for _ in range(3)]
    assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [3, 4]
    assert decode_batch(replies[0][3])[1] == [BlockRemoved([3], medium="GPU")]
    assert replies[2][1:] == [b"", END_SEQ, b""]
    pub.close()


def test_publisher_refuses_an_unbindable_endpoint(ctx):
    with pytest.raises(ValueError, match="cannot bind"):
        KvEventPublisher("tcp://256.1.1.1:*", context=ctx)


# ------------------------------------------------------------------ SGLang's bind/connect rule, per release


@pytest.mark.parametrize(
    ("endpoint", "bind", "release", "binds"),
    [
        ("tcp://127.0.0.1:5557", None, "0.5.23", False),  # the config kvroute used to pass: SGLang connects
        ("tcp://127.0.0.1:5557", True, "0.5.23", True),  # "bind" is honoured from 0.5.22 …
        ("tcp://127.0.0.1:5557", True, "0.5.20", False),  # … and silently dropped before
        ("tcp://*:5557", False, "0.5.23", False),
        ("tcp://*:5557", None, "0.4.9", True),
        ("tcp://[::1]:5557", None, "0.4.9", True),  # a substring test: any "::" binds
        ("tcp://0.0.0.0:5557", None, "0.5.12", False),  # 0.0.0.0 binds only from 0.5.14
        ("tcp://0.0.0.0:5557", None, "0.5.14", True),
        ("ipc:///tmp/x", None, "0.4.9", True),
    ],
)
def test_publisher_binds_or_connects_as_the_release_decides(endpoint, bind, release, binds):
    assert pub_binds(endpoint, bind, release) is binds


def test_ranks_offset_the_tcp_port_and_refuse_ipc():
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("ipc:///tmp/x", 0) == "ipc:///tmp/x"
    with pytest.raises(ValueError):
        offset_endpoint("ipc:///tmp/x", 1)


def test_a_connecting_publisher_reaches_a_bound_subscriber_and_not_a_connecting_one(ctx):
    bound = ctx.socket(zmq.SUB)
    bound.setsockopt(zmq.LINGER, 0)
    bound.setsockopt(zmq.SUBSCRIBE, b"")
    port = bound.bind_to_random_port("tcp://127.0.0.1")
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", release="0.5.23", context=ctx)
    assert not pub.binds
    # a second subscriber that CONNECTS to the same address (kvroute's old behaviour) gets nothing:
    # nobody listens there but the first subscriber, and SUB to SUB never carries a message
    stray = ctx.socket(zmq.SUB)
    stray.setsockopt(zmq.LINGER, 0)
    stray.setsockopt(zmq.SUBSCRIBE, b"")
    stray.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(200):
        pub.publish([BlockRemoved([1])], ts=1.0)
        if bound.poll(10):
            break
    assert bound.recv_multipart()[0] == b""
    assert not stray.poll(200)
    pub.close()


@pytest.mark.parametrize(("release", "with_topic"), [("0.5.14", False), ("0.5.23", True)])
def test_replay_frames_follow_the_release(ctx, tmp_path, release, with_topic):
    pub = KvEventPublisher(f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                           topic="kv", release=release, context=ctx)
    pub.publish([BlockRemoved([7])], ts=1.0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    for _ in range(200):
        if pub.serve_replay():
            break
        dealer.poll(10)
    batch, end = _recv(dealer), _recv(dealer)
    if with_topic:
        assert batch[:3] == [b"", b"kv", (0).to_bytes(8, "big")] and end == [b"", b"", END_SEQ, b""]
    else:
        assert batch[:2] == [b"", (0).to_bytes(8, "big")] and len(batch) == 3 and end == [b"", END_SEQ, b""]
    pub.close()


def test_sim_cli_takes_sglangs_kv_events_config_and_encodes_as_its_release():
    from sim.__main__ import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args([
        "--port", "1", "--wire", "0.5.14", "--kv-events-config",
        '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events", '
        '"replay_endpoint": "tcp://127.0.0.1:5657", "bind": true, "buffer_steps": 7}']))
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic) == (
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5657", "kv-events")
    assert cfg.kv_events_bind is True and cfg.kv_events_buffer_steps == 7
    assert cfg.events_encoding == "array"  # tagged arrays up to 0.5.18
    assert not pub_binds(cfg.kv_events_endpoint, cfg.kv_events_bind, cfg.wire)  # 0.5.14 drops "bind"
    later = config_from_args(build_parser().parse_args(["--port", "1", "--wire", "0.5.20"]))
    assert later.events_encoding == "map"
