"""actors.protocol: typed frames of the metrics plane — what decodes, and everything that must not."""

from __future__ import annotations

import math
import os
import pickle

import msgspec
import pytest

from actors.protocol import (
    MAX_INGEST_FRAME_BYTES, FleetDelta, InFlightShare, KvEventsStatus, KvHandshakeSide, ManagedEngine, ProtocolError,
    RankMetrics, ReportBatch, WorkerReport, WorkerUpdate, decode_delta, decode_ingest, encode, encode_delta,
)


def rank(**over):
    v = dict(request_active_slots=3, request_total_slots=64, kv_active_blocks=100, kv_total_blocks=1000,
             num_requests_waiting=1, gpu_cache_usage_perc=0.1, gpu_prefix_cache_hit_rate=0.5, data_parallel_rank=0,
             age_s=0.01, seq=7)
    v.update(over)
    return RankMetrics(**v)


def report(**over):
    v = dict(name="w1", url="http://127.0.0.1:1", page_size=16, incarnation="inc", healthy=True, health_detail="ok",
             ranks=[rank()], managed=ManagedEngine(process="running", pid=4))
    v.update(over)
    return WorkerReport(**v)


def test_a_report_batch_and_an_in_flight_share_round_trip_on_one_socket():
    b = ReportBatch(token="t", reports=[report(), report(name="w2")])
    s = InFlightShare(token="t", replica="r1", counts={"w1": 2})
    assert decode_ingest(encode(b)) == b
    assert decode_ingest(encode(s)) == s


def test_a_report_frame_is_small():
    assert len(encode(ReportBatch(token="x" * 32, reports=[report()]))) < 200


def test_rank_values_are_the_eight_sglang_fields():
    assert rank().values() == dict(request_active_slots=3, request_total_slots=64, kv_active_blocks=100,
                                   kv_total_blocks=1000, num_requests_waiting=1, gpu_cache_usage_perc=0.1,
                                   gpu_prefix_cache_hit_rate=0.5, data_parallel_rank=0)


@pytest.mark.parametrize("frame", [
    b"",
    b"\x80\x05garbage",
    pickle.dumps({"a": 1}),
    msgspec.msgpack.encode({"token": "t", "reports": []}),  # a map, not the tagged array
    msgspec.msgpack.encode(["x", "t", []]),  # unknown tag
    msgspec.msgpack.encode(["r", "t", [["w", "u", 16, "i", True, "", [[1, 1, 1, 1, -1, 0.1, 0.1, 0, 0.0, 1]]]]]),
    msgspec.msgpack.encode(["r", "t", [["w", "u", 16, "i", True, "", [[1, 1, 1, 1, 1, 1.5, 0.1, 0, 0.0, 1]]]]]),
    msgspec.msgpack.encode(["r", "t", [["w", "u", 0, "i", True, "", []]]]),  # page size 0
    msgspec.msgpack.encode(["r", "t", [["", "u", 16, "i", True, "", []]]]),  # empty name
    msgspec.msgpack.encode(["f", "t", "r1", {"w1": "many"}]),
    msgspec.msgpack.encode(["r", "t", [["w", "u", 16, "i", True, "", [[1, 1, 1, 1, 1, 0.1, 0.1, 0, math.inf, 1]]]]]),
])
def test_anything_but_a_well_formed_message_is_refused(frame):
    with pytest.raises(ProtocolError):
        decode_ingest(frame)


def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    with pytest.raises(ProtocolError):
        decode_ingest(pickle.dumps(Evil()))
    assert not target.exists()


def test_oversized_frames_are_refused_before_decoding():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_ingest(b"\x00" * (MAX_INGEST_FRAME_BYTES + 1))


def test_a_delta_round_trips_and_garbage_is_refused():
    w = WorkerUpdate(name="w1", url="u", page_size=16, state="live", healthy=True, health_detail="ok",
                     metrics_age_s=0.1, heartbeat_age_s=0.2, ranks=[rank()], in_flight_by_replica={"r": 1},
                     version=3, kv_events_actor="kvroute-worker-w1",
                     kv_events=KvEventsStatus(status="ok", handshake=[KvHandshakeSide(0, "bind", "tcp://h:1")], batches=2))
    d = FleetDelta(epoch="e", version=3, prev_version=1, full=False, workers=[w], names=None)
    assert decode_delta(encode_delta(d)) == d
    with pytest.raises(ProtocolError):
        decode_delta(b"\x93garbage")


def test_the_well_formed_twin_of_each_refused_frame_decodes():
    """So each refusal above is for its one fault, not for the frame's shape."""
    msg = decode_ingest(msgspec.msgpack.encode(
        ["r", "t", [["w", "u", 16, "i", True, "", [[1, 1, 1, 1, 1, 0.1, 0.1, 0, 0.0, 1]]]]]))
    assert msg.reports[0].name == "w" and msg.reports[0].ranks[0].seq == 1


def test_a_report_has_no_free_form_field_a_grab_bag_dict_is_refused():
    frame = msgspec.msgpack.encode(["r", "t", [["w", "u", 16, "i", True, "", [], {"kv_events_actor": "x"}]]])
    with pytest.raises(ProtocolError):
        decode_ingest(frame)


def test_the_slow_worker_fields_travel_named_and_typed():
    r = report(kv_events_actor="kvroute-worker-w1",
               kv_events=KvEventsStatus(status="silent", handshake=[KvHandshakeSide(0, "connect", "tcp://h:2")],
                                        batches=0, detail="why"))
    back = decode_ingest(encode(ReportBatch(token="t", reports=[r]))).reports[0]
    assert back.managed == ManagedEngine(process="running", pid=4)
    assert back.kv_events_actor == "kvroute-worker-w1" and back.kv_events.handshake[0].kvroute == "connect"
