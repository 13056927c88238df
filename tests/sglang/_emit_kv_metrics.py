"""Run in a child process (SGLang reads SGLANG_USE_PICKLE_IPC once, at import): SGLang's own
scheduler KvMetrics publisher pushes COUNT reports to ENDPOINT; prints the values it was given.

    python -m tests.sglang._emit_kv_metrics COUNT ENDPOINT [ENDPOINT …]   (one publisher per endpoint)
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from types import SimpleNamespace

import pytest
import zmq

from tests.sglang.compat import scheduler_kv_publisher

MAX_RUNNING, MAX_TOTAL = 48, 131_072


def main() -> None:
    count, endpoints = int(sys.argv[1]), sys.argv[2:]
    ctx = zmq.Context()
    stats = SimpleNamespace()
    mp = pytest.MonkeyPatch()
    pubs, socks = [], []
    for endpoint in endpoints:
        sock = ctx.socket(zmq.PUSH)  # what the scheduler creates (connect; kvroute's actor binds)
        sock.connect(endpoint)
        socks.append(sock)
        pubs.append(scheduler_kv_publisher(
            mp, kv_events_config=json.dumps({"publisher": "zmq", "topic": "kv-events",
                                             "endpoint": "tcp://127.0.0.1:9"}),
            sock=sock, max_running_requests=MAX_RUNNING, max_total_num_tokens=MAX_TOTAL, get_stats=lambda: stats))
    sent = []
    for i in range(count):
        running, waiting = i % 7, (i * 3) % 5
        usage = round((i + 1) / (count + 3), 6)
        hit = 0.0 if i % 2 else round(i / (2 * count), 6)  # decode reports carry 0.0
        stats.num_running_reqs = SimpleNamespace(total=running)
        stats.num_queue_reqs = SimpleNamespace(total=waiting)
        stats.token_usage, stats.cache_hit_rate = usage, hit
        for pub in pubs:
            pub.emit_kv_metrics()
        sent.append({"request_active_slots": running, "request_total_slots": MAX_RUNNING,
                     "kv_active_blocks": int(usage * MAX_TOTAL), "kv_total_blocks": MAX_TOTAL,
                     "num_requests_waiting": waiting, "gpu_cache_usage_perc": usage,
                     "gpu_prefix_cache_hit_rate": hit, "data_parallel_rank": 0})
        time.sleep(0.005)
    time.sleep(0.3)  # let ZMQ flush before the context goes
    for pub, sock in zip(pubs, socks):
        pub.kv_event_publisher.shutdown()
        atexit.unregister(pub.kv_event_publisher.shutdown)
        sock.close(linger=1000)
    ctx.term()
    print(json.dumps(sent))


if __name__ == "__main__":
    main()
