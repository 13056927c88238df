"""The sim's KvMetrics socket: PUSH connects, frames decode with the receiver's own decoder."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from actors.wire import decode_kv_metrics
from sim.engine import KvReport
from sim.metrics_emitter import MetricsEmitter
from sim.sglang_shapes import WIRE_FORMS

REPORT = KvReport(
    request_active_slots=3,
    request_total_slots=64,
    kv_active_blocks=1234,
    kv_total_blocks=400_000,
    num_requests_waiting=2,
    gpu_cache_usage_perc=0.003085,
    gpu_prefix_cache_hit_rate=0.75,
    data_parallel_rank=1,
)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("wire", sorted(WIRE_FORMS))
def test_a_bound_pull_receives_frames_the_receiver_decodes(ctx, tmp_path, wire):
    endpoint = f"ipc://{tmp_path}/m-{uuid.uuid4().hex[:8]}"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(endpoint)  # the receiver binds; the sim only connects
    emitter = MetricsEmitter(endpoint, wire, context=ctx)
    deadline = time.monotonic() + 5
    while not emitter.send(REPORT):  # the connection may take a moment to come up
        assert time.monotonic() < deadline, "emitter never connected"
        time.sleep(0.01)
    assert pull.poll(2000)
    metrics = decode_kv_metrics(pull.recv())
    assert metrics.model_dump() == REPORT.as_dict()
    emitter.close()


def test_send_never_blocks_when_nobody_listens(ctx, tmp_path):
    emitter = MetricsEmitter(f"ipc://{tmp_path}/nobody", "0.5.23", context=ctx)
    t0 = time.monotonic()
    results = [emitter.send(REPORT) for _ in range(2000)]
    assert time.monotonic() - t0 < 2.0
    # ZMQ may queue up to the high-water mark for a pending ipc peer; past that it drops
    assert emitter.sent + emitter.dropped == 2000
    assert results.count(True) == emitter.sent
    emitter.close()


def test_tcp_connect_without_receiver_drops_instead_of_stalling(ctx):
    emitter = MetricsEmitter("tcp://127.0.0.1:1", "0.5.23-msgpack", context=ctx)
    t0 = time.monotonic()
    for _ in range(100):
        emitter.send(REPORT)
    assert time.monotonic() - t0 < 1.0
    emitter.close()
    assert emitter.send(REPORT) is False


def test_emitter_refuses_unknown_wire_and_bad_endpoint(ctx):
    with pytest.raises(ValueError, match="unknown wire form"):
        MetricsEmitter("ipc:///tmp/x", "9.9.9", context=ctx)
    with pytest.raises(ValueError, match="not a ZMQ address"):
        MetricsEmitter("nonsense", "0.5.23", context=ctx)
