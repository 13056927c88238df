"""actors.worker.ingest: latest value per DP rank (DP-attention shares one tcp:// address), blocks, counters."""

from actors.worker.ingest import MetricsBook
from sim.sglang_shapes import encode_kv_metrics

BASE = dict(request_active_slots=1, request_total_slots=8, kv_active_blocks=100, kv_total_blocks=1600,
            num_requests_waiting=0, gpu_cache_usage_perc=0.0625, gpu_prefix_cache_hit_rate=0.0)


def test_dp_attention_ranks_on_one_socket_are_kept_apart_by_data_parallel_rank():
    book = MetricsBook(65536)
    for rank, active in ((0, 3), (1, 5), (0, 4)):
        book.ingest(encode_kv_metrics("0.5.23", **{**BASE, "request_active_slots": active, "data_parallel_rank": rank}))
    latest = book.latest()
    assert sorted(latest) == [0, 1]
    assert latest[0].request_active_slots == 4 and latest[1].request_active_slots == 5


def test_token_counts_become_blocks_of_the_page_size_and_each_change_gets_a_new_seq():
    book = MetricsBook(65536)
    book.ingest(encode_kv_metrics("0.5.8", **{**BASE, "data_parallel_rank": 0}))
    first = book.ranks_report(page_size=16)[0]
    assert first["kv_active_blocks"] == 7  # ceil(100 / 16)
    assert first["kv_total_blocks"] == 100
    book.ingest(encode_kv_metrics("0.5.8", **{**BASE, "data_parallel_rank": 0}))
    assert book.ranks_report(16)[0]["seq"] == first["seq"] + 1


def test_refusals_are_counted_by_reason_and_do_not_touch_the_latest_value():
    book = MetricsBook(65536)
    book.ingest(encode_kv_metrics("0.5.23", **{**BASE, "data_parallel_rank": 0}))
    book.ingest(b"\x00garbage")
    book.ingest(b"x" * 70000)
    assert book.stats.as_dict()["refused_by_reason"] == {"unknown_format": 1, "oversized": 1}
    assert book.stats.frames_received == 3 and book.stats.frames_accepted == 1
    assert book.latest()[0].request_active_slots == 1


def test_rank_metrics_are_the_ranks_report_as_a_report_carries_them():
    from actors.protocol import RankMetrics

    for page in (1, 16):
        book = MetricsBook(65536, clock=lambda: 5.0)
        for rank, active in ((0, 3), (1, 5), (0, 4)):
            book.ingest(encode_kv_metrics("0.5.23", **{**BASE, "request_active_slots": active,
                                                       "data_parallel_rank": rank}))
        assert book.rank_metrics(page) == [RankMetrics(**d) for d in book.ranks_report(page).values()]
        assert book.rank_metrics(page)[0].kv_active_blocks == -(-100 // page)
