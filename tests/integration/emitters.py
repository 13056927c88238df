"""Emitters that behave like SGLang's scheduler: PUSH connect, one frame per KvMetrics."""

from __future__ import annotations

import zmq

from sim.sglang_shapes import encode_kv_metrics

BASE = dict(
    request_active_slots=0, request_total_slots=64, kv_active_blocks=0, kv_total_blocks=160_000,
    num_requests_waiting=0, gpu_cache_usage_perc=0.0, gpu_prefix_cache_hit_rate=0.0, data_parallel_rank=0,
)


class Emitter:
    def __init__(self, endpoint: str, form: str = "0.5.23") -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.form = form

    def send(self, **values) -> None:
        self.sock.send(encode_kv_metrics(self.form, **{**BASE, **values}))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def close(self) -> None:
        self.sock.close(linger=0)
