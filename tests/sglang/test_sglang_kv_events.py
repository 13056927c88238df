"""SGLang's own KV-event side into kvroute's exact prefix index: its `ZmqEventPublisher`, configured
as kvroute configures a managed engine, its radix cache's real `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` events (where that cache imports here), its replay ROUTER — through a live worker
actor to a router whose `/route` follows them. A forwarder between publisher and actor drops one
batch on request, so a gap is real, not simulated."""

from __future__ import annotations

import atexit
import json
import threading
import time

import httpx
import pytest
import zmq

from tests.sglang.compat import RELEASE, EventSource, kv_events_module, sglang  # noqa: F401

from actors.fleet import parse_fleet
from actors.worker.launcher import kv_events_config
from tests.conftest import free_port
from tests.integration.helpers import HealthServer, wait_for

pytestmark = [pytest.mark.sglang, pytest.mark.ray]
PAGE = 16
PREFIX = "/sglang-kv"


class DroppingForwarder:
    """SGLang's PUB connects to our bound SUB at `inbound`; we forward to kvroute's actor (bound at
    `outbound`) and drop the batches whose seq is in `drop`."""

    def __init__(self, outbound: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.inbound = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(outbound)
        self.drop: set[int] = set()
        self.seen: list[int] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.sub.poll(50):
                frames = self.sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                self.seen.append(seq)
                if seq not in self.drop:
                    self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sub.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def _body(text: str) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def _ids(body: dict) -> list[int]:
    from serve_app.prompt_tokens import body_token_ids, load_tokenizer

    return list(body_token_ids(load_tokenizer("sim"), body))


def _overlap(decision: dict) -> int:
    reason = decision["reason"]
    return int(reason.split("overlap=")[1].split("/")[0]) if "overlap=" in reason else 0


@pytest.fixture(scope="module")
def env(ray_cluster, serve_port, tmp_path_factory):
    import ray
    from ray import serve

    from actors.worker.actor import start_worker
    from serve_app.app import build_app

    tmp = tmp_path_factory.mktemp("sgkv")
    actor_port, replay_port = free_port(), free_port()
    http_sg, http_other = HealthServer(), HealthServer()
    fleet = parse_fleet({"workers": [
        # the actor BINDS this concrete address (SGLang connects to it) and asks SGLang's replay ROUTER
        {"name": "sg", "url": http_sg.url, "page_size": PAGE, "metrics_endpoint": f"ipc://{tmp}/sg.metrics",
         "kv_events_endpoint": f"tcp://127.0.0.1:{actor_port}",
         "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay_port}"},
        {"name": "other", "url": http_other.url, "page_size": PAGE, "metrics_endpoint": f"ipc://{tmp}/o.metrics"},
    ]})
    spec = fleet.workers[0]
    start = lambda: start_worker(spec, fleet.settings, name_prefix="sgkv-")  # noqa: E731
    actors = {"sg": start(), "other": start_worker(fleet.workers[1], fleet.settings, name_prefix="sgkv-")}
    ray.get([a.ready.remote() for a in actors.values()], timeout=60)
    fwd = DroppingForwarder(f"tcp://127.0.0.1:{actor_port}")
    # exactly the --kv-events-config kvroute's launcher gives a managed engine, pointed at the forwarder
    cfg = kv_events_config(spec.model_copy(update={"kv_events_endpoint": fwd.inbound}), "127.0.0.1")
    assert cfg == {"publisher": "zmq", "topic": "kv-events", "endpoint": fwd.inbound,
                   "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    publisher = kv_events_module().EventPublisherFactory.create(json.dumps(cfg), 0)
    serve.run(build_app({"fleet": fleet.model_dump(mode="json"), "manage_fleet": False,
                         "router": {"policy": "kv_aware", "tokenizer": "sim", "block_size": PAGE, "seed": 3}}),
              name="sgkv", route_prefix=PREFIX)
    client = httpx.Client(base_url=f"http://127.0.0.1:{serve_port}{PREFIX}", timeout=30)
    wait_for(lambda: len(client.get("/workers").json()["workers"]) == 2, 30, what="router sees both workers")
    state = {"client": client, "actors": actors, "start": start, "fwd": fwd, "publisher": publisher,
             "source": EventSource(PAGE)}
    yield state
    client.close()
    serve.delete("sgkv")
    publisher.shutdown()
    atexit.unregister(publisher.shutdown)  # SGLang registers it; once is enough
    fwd.close()
    for a in state["actors"].values():
        try:
            ray.get(a.stop.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(a, no_restart=True)
    http_sg.close()
    http_other.close()


def _publish(env, *, drop: bool = False) -> list:
    """SGLang's batch of whatever the cache recorded since the last one; returns its events."""
    ke = kv_events_module()
    events = env["source"].take_events()
    assert events, "the cache recorded nothing"
    seq = len(env["fwd"].seen)
    if drop:
        env["fwd"].drop.add(seq)
    env["publisher"].publish(ke.KVEventBatch(ts=time.time(), events=events))
    wait_for(lambda: len(env["fwd"].seen) > seq, 10, what=f"batch {seq} out of SGLang's publisher")
    return events


def _kv(env) -> dict:
    import ray

    import msgspec

    kv = ray.get(env["actors"]["sg"].stats.remote()).kv_events  # a typed KvEventsCounters
    sub = kv.subscription  # a typed KvEventsStatus
    return {**msgspec.structs.asdict(kv), "batches": sub.batches, "status": sub.status,
            "handshake": [msgspec.structs.asdict(side) for side in sub.handshake]}


def _prime(env) -> None:
    """SGLang's PUB drops until the forwarder's subscription reached it: push empty-cache batches first."""
    ke = kv_events_module()
    for _ in range(100):
        env["publisher"].publish(ke.KVEventBatch(ts=time.time(), events=[ke.AllBlocksCleared()]))
        time.sleep(0.05)
        if env["fwd"].seen:
            break
    assert env["fwd"].seen, "SGLang's publisher never reached the forwarder"
    # batches sent before the subscription existed were dropped by PUB: renumber from what arrived
    env["fwd"].seen[:] = list(range(env["fwd"].seen[-1] + 1))
    wait_for(lambda: _kv(env)["batches"] > 0, 10, what="the actor hears SGLang's publisher")


P1 = "the harbour master logs every kite that crosses the breakwater at dusk " * 6
P2 = "a second conversation about lighthouse lenses and their fresnel rings " * 6
P3 = "a third about tide tables printed on waxed paper for the fishing fleet " * 6


def test_real_events_are_applied_and_route_follows_them(env):
    _prime(env)
    c = env["client"]
    ids = _ids(_body(P1))
    env["source"].insert(ids)
    _publish(env)
    want = len(ids) // PAGE
    kv = wait_for(lambda: (k := _kv(env))["blocks"] >= want and k, 10, what="P1's pages in the actor's log")
    assert kv["refused"] == {} and kv["gaps"] == 0 and kv["status"] == "ok"
    assert kv["handshake"] == [{"rank": 0, "kvroute": "bind", "address": kv["endpoint"]}]
    d = wait_for(lambda: (x := c.post("/route", json=_body(P1)).json())["worker"] == "sg" and _overlap(x) and x,
                 10, what="route P1 to sg by exact overlap")
    assert _overlap(d) == want


def test_a_dropped_batch_is_a_gap_and_the_replay_router_fills_it(env):
    before = _kv(env)
    env["source"].insert(_ids(_body(P2)))
    _publish(env, drop=True)  # never reaches the actor
    env["source"].insert(_ids(_body(P3)))
    _publish(env)
    kv = wait_for(lambda: (k := _kv(env))["gaps"] == before["gaps"] + 1 and k["replayed"] > before["replayed"] and k,
                  15, what="gap detected and replayed")
    want2, want3 = len(_ids(_body(P2))) // PAGE, len(_ids(_body(P3))) // PAGE
    assert kv["blocks"] == before["blocks"] + want2 + want3  # nothing lost: the replay had P2's batch
    for prompt, want in ((P2, want2), (P3, want3)):
        d = wait_for(lambda: (x := env["client"].post("/route", json=_body(prompt)).json())["worker"] == "sg"
                     and _overlap(x) == want and x, 10, what="route follows replayed and live events")
        assert d


def test_a_restarted_actor_rebuilds_the_index_from_sglangs_replay_buffer(env):
    import ray

    held = _kv(env)["blocks"]
    old = env["actors"]["sg"]
    ray.get(old.stop.remote(deregister=False), timeout=30)
    ray.kill(old, no_restart=True)
    env["actors"]["sg"] = env["start"]()
    ray.get(env["actors"]["sg"].ready.remote(), timeout=60)
    time.sleep(0.5)  # SGLang's PUB reconnects to the new actor's SUB (forwarder in between)
    env["fwd"].pub.close(linger=0)  # the forwarder's PUB reconnects to the rebound port
    env["fwd"].pub = env["fwd"].ctx.socket(zmq.PUB)
    env["fwd"].pub.connect(_kv(env)["endpoint"])
    time.sleep(0.5)
    env["source"].evict_last()  # one more real event: BlockRemoved of a leaf (all its pages)
    events = _publish(env)
    assert events and all(type(e).__name__ == "BlockRemoved" for e in events)
    gone = sum(len(e.block_hashes) for e in events)  # one event per page up to 0.5.18, merged from 0.5.20
    kv = wait_for(lambda: (k := _kv(env))["replayed"] > 0 and k["blocks"] == held - gone and k, 15,
                  what=f"new actor replays everything from seq 0, then removes {gone} of {held} blocks")
    assert kv["gaps"] == 0 and kv["refused"] == {}


def test_all_blocks_cleared_ends_every_affinity(env):
    env["source"].clear()
    _publish(env)
    wait_for(lambda: _kv(env)["blocks"] == 0, 10, what="AllBlocksCleared applied")
    d = wait_for(lambda: (x := env["client"].post("/route", json=_body(P1)).json()) and _overlap(x) == 0 and x,
                 10, what="no overlap claimed after the cache was cleared")
    assert d["worker"] in ("sg", "other")
