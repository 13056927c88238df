"""Who binds the KV-event socket: kvroute decides exactly as each SGLang release does, never binds a
wildcard, and flags a subscription that hears nothing while the engine is busy."""

from __future__ import annotations

import pytest

from actors.fleet import FleetError, parse_fleet
from actors.wire.kv_events import KvEventError, REPLAY_END_SEQ, replay_reply
from actors.wire.kv_handshake import HandshakeError, SilenceWatch, plan_subscription, publisher_binds, shows_prefill

END = REPLAY_END_SEQ.to_bytes(8, "big")


@pytest.mark.parametrize(
    ("endpoint", "bind", "release", "binds"),
    [
        ("tcp://127.0.0.1:5557", None, "0.5.23", False),  # issue 21: SGLang connects here
        ("tcp://127.0.0.1:5557", None, "0.4.9", False),
        ("tcp://127.0.0.1:5557", True, "0.5.22", True),
        ("tcp://127.0.0.1:5557", True, "0.5.21", False),  # "bind" dropped before 0.5.22
        ("tcp://*:5557", None, "0.4.9", True),
        ("tcp://[::1]:5557", None, "0.5.23", True),  # "::" is a substring test in every release
        ("tcp://0.0.0.0:5557", None, "0.5.12", False),
        ("tcp://0.0.0.0:5557", None, "0.5.14", True),
        ("ipc:///tmp/kv", None, "0.4.9", True),
    ],
)
def test_publisher_direction_follows_each_releases_rule(endpoint, bind, release, binds):
    assert publisher_binds(endpoint, bind, release) is binds


def test_a_concrete_tcp_endpoint_makes_kvroute_bind_it():
    [plan] = plan_subscription("tcp://10.0.0.5:5557")
    assert (plan.side, plan.address) == ("bind", "tcp://10.0.0.5:5557")


def test_a_wildcard_publisher_is_connected_to_on_the_engines_host_never_bound():
    [plan] = plan_subscription("tcp://*:5557", peer_host="10.0.0.5")
    assert (plan.side, plan.address) == ("connect", "tcp://10.0.0.5:5557")
    [plan] = plan_subscription("tcp://[::]:5557")
    assert (plan.side, plan.address) == ("connect", "tcp://[::1]:5557")


def test_bind_true_and_ipc_make_kvroute_connect():
    assert plan_subscription("tcp://127.0.0.1:5557", bind=True)[0].side == "connect"
    assert plan_subscription("ipc:///tmp/kv")[0].side == "connect"


def test_dp_ranks_get_base_plus_rank_and_replay_follows():
    plans = plan_subscription("tcp://127.0.0.1:5557", replay_endpoint="tcp://*:6000", ranks=3,
                              peer_host="127.0.0.1")
    assert [(p.side, p.address, p.replay) for p in plans] == [
        ("bind", f"tcp://127.0.0.1:{5557 + r}", f"tcp://127.0.0.1:{6000 + r}") for r in range(3)
    ]


@pytest.mark.parametrize(
    ("endpoint", "bind", "ranks", "match"),
    [
        ("tcp://0.0.0.0:5557", None, 1, "0.5.12 connects"),
        ("inproc://kv", None, 1, "process-local"),
        ("tcp://*:5557", False, 1, "wildcard"),
        ("ipc:///tmp/kv", None, 2, "ipc"),
    ],
)
def test_forms_that_cannot_work_are_refused_with_the_fix(endpoint, bind, ranks, match):
    with pytest.raises(HandshakeError, match=match):
        plan_subscription(endpoint, bind=bind, ranks=ranks)


def test_fleet_refuses_an_ambiguous_kv_endpoint_naming_the_entry():
    with pytest.raises(FleetError, match=r"workers\[0\].*0\.0\.0\.0"):
        parse_fleet({"workers": [{"name": "a", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/a",
                                  "kv_events_endpoint": "tcp://0.0.0.0:5557"}]})
    spec = parse_fleet({"workers": [{"name": "a", "url": "http://127.0.0.1:1", "metrics_endpoint": "ipc:///tmp/a",
                                     "kv_events_endpoint": "tcp://*:5557", "kv_events_bind": None}]}).workers[0]
    assert spec.kv_events_endpoint == "tcp://*:5557"


def test_replay_replies_of_both_release_forms_become_live_frames():
    seq = (4).to_bytes(8, "big")
    assert replay_reply([b"", seq, b"p"], topic=b"t") == [b"t", seq, b"p"]  # ≤ 0.5.21
    assert replay_reply([b"", b"t", seq, b"p"]) == [b"t", seq, b"p"]  # ≥ 0.5.22
    assert replay_reply([b"", END, b""]) is None
    assert replay_reply([b"", b"", END, b""]) is None
    with pytest.raises(KvEventError):
        replay_reply([b"", b"x"])


def test_silence_is_flagged_only_after_the_engine_showed_prefills_for_the_window():
    w = SilenceWatch(silence_s=5.0)
    assert w.observe(0.0, batches=0, busy=False) == "waiting"  # idle engine: fine
    assert w.observe(1.0, batches=0, busy=True) == "waiting"
    assert w.observe(5.9, batches=0, busy=False) == "waiting"  # the burst ended: the evidence stands
    assert w.observe(6.0, batches=0, busy=False) == "silent"
    assert w.observe(6.5, batches=1, busy=True) == "ok"


def test_only_fresh_reports_of_a_held_page_are_evidence():
    assert shows_prefill(320, 16, received_at=10.0, opened_at=5.0)
    assert not shows_prefill(15, 16, received_at=10.0, opened_at=5.0)  # less than a page
    assert not shows_prefill(320, 16, received_at=5.1, opened_at=5.0)  # PUSH backlog from before we listened
