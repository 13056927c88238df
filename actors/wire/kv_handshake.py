"""Who binds the KV-event socket: SGLang's publisher or kvroute's subscriber, decided exactly as SGLang does.

SGLang's `ZmqEventPublisher` (sglang/srt/disaggregation/kv_events.py) binds or connects its PUB
by looking at the `--kv-events-config` endpoint string (facts read from the released wheels):

| releases        | PUB binds when                                                      | else     |
|-----------------|---------------------------------------------------------------------|----------|
| 0.4.9 – 0.5.12  | `"*"` or `"::"` in the endpoint, or it starts with ipc:// / inproc:// | connects |
| 0.5.14 – 0.5.21 | the same, or `"0.0.0.0"` in the endpoint                            | connects |
| 0.5.22 – 0.5.23 | the config's `"bind"` (true/false) when given, else the rule above   | connects |

Releases before 0.5.22 ignore a `"bind"` key silently (pydantic drops unknown keys), so
`"bind": true` alone is not a fix for them. Every release: rank r publishes on port base + r
(tcp; an ipc:// endpoint with rank > 0 is refused by SGLang), and the optional replay ROUTER
always binds (also base + r).

kvroute never binds a wildcard: where SGLang connects, the worker actor BINDS its SUB on that
concrete address (the same direction as the metrics PULL); where SGLang binds, the actor connects.
A `tcp://0.0.0.0:P` endpoint is refused because the releases disagree on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Side = Literal["bind", "connect"]

RELEASE_ZERO_ADDR_BINDS = (0, 5, 14)  # first release whose heuristic binds "0.0.0.0"
RELEASE_BIND_KEY = (0, 5, 22)  # first release that honours "bind" in --kv-events-config
RELEASE_REPLAY_TOPIC = (0, 5, 22)  # first release whose replay frames carry the topic


class HandshakeError(ValueError):
    """A KV-event endpoint kvroute cannot subscribe to safely; the message says what to use instead."""


def parse_release(release: str) -> tuple[int, int, int]:
    """`"0.5.23"` / `"0.5.23-msgpack"` / `"0.4.9.post1"` → `(0, 5, 23)`."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", release)
    if not m:
        raise ValueError(f"not an SGLang release: {release!r}")
    return int(m[1]), int(m[2]), int(m[3])


def publisher_binds(endpoint: str, bind: bool | None = None, release: str | None = None) -> bool:
    """Whether SGLang `release`'s ZmqEventPublisher binds (True) or connects (False) its PUB.

    `release=None` means "any claimed release": `bind` is honoured and `0.0.0.0` counts as a bind,
    which is right from 0.5.14 on (callers that cannot know the release refuse `0.0.0.0`)."""
    rel = parse_release(release) if release else None
    if bind is not None and (rel is None or rel >= RELEASE_BIND_KEY):
        return bind
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    if "0.0.0.0" in endpoint:
        return rel is None or rel >= RELEASE_ZERO_ADDR_BINDS
    return False


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of attention-DP rank `rank`, as SGLang offsets it (tcp: port + rank)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    raise HandshakeError(f"{endpoint}: SGLang offsets only tcp:// endpoints per DP rank; use tcp:// with dp_size > 1")


def _host(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def _reachable(endpoint: str, peer_host: str | None) -> str:
    """Where a subscriber connects to reach a publisher bound on `endpoint` (wildcards → the peer's host)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host = _host(endpoint)
    if host in ("*", "0.0.0.0", "::", ""):
        target = peer_host or ("::1" if host == "::" else "127.0.0.1")
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://[{target}]:{port}" if ":" in target else f"tcp://{target}:{port}"
    return endpoint


@dataclass(frozen=True, slots=True)
class KvEventsPlan:
    """What the worker actor does for one DP rank: `side` ("bind" | "connect") on `address`;
    `replay` is the replay ROUTER to connect to (None: the engine offers none)."""

    rank: int
    side: Side
    address: str
    replay: str | None = None

    def describe(self) -> str:
        who = "SGLang connects, kvroute binds" if self.side == "bind" else "SGLang binds, kvroute connects"
        return f"rank {self.rank}: {who} {self.address}"


def plan_subscription(
    endpoint: str,
    *,
    bind: bool | None = None,
    replay_endpoint: str | None = None,
    ranks: int = 1,
    peer_host: str | None = None,
) -> list[KvEventsPlan]:
    """How the worker actor meets SGLang's publisher given the `--kv-events-config` values
    (`endpoint`, `bind`, `replay_endpoint`) and the number of attention-DP ranks.
    `peer_host`: the engine's host, for endpoints SGLang binds on a wildcard.
    Raises `HandshakeError` for forms that cannot work or that releases disagree on."""
    if endpoint.startswith("inproc://"):
        raise HandshakeError(f"{endpoint}: inproc:// is process-local; use tcp://HOST:PORT or ipc://PATH")
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise HandshakeError(f"{endpoint}: must be tcp://HOST:PORT or ipc://PATH")
    if bind is None and endpoint.startswith("tcp://") and "0.0.0.0" in endpoint:
        raise HandshakeError(
            f"{endpoint}: SGLang ≤ 0.5.12 connects to 0.0.0.0 while ≥ 0.5.14 binds it; say tcp://*:PORT "
            "for a publisher that binds, or a concrete address (kvroute binds it) instead"
        )
    sglang_binds = publisher_binds(endpoint, bind)
    if not sglang_binds and endpoint.startswith("tcp://") and _host(endpoint) in ("*", "::", ""):
        raise HandshakeError(f"{endpoint}: with bind false SGLang would connect to a wildcard; give a concrete host")
    if ranks > 1 and endpoint.startswith("ipc://"):
        raise HandshakeError(f"{endpoint}: SGLang refuses ipc:// publishers on DP ranks > 0; use tcp://")
    plans = []
    for r in range(ranks):
        ep = rank_endpoint(endpoint, r)
        replay = _reachable(rank_endpoint(replay_endpoint, r), peer_host) if replay_endpoint else None
        if sglang_binds:
            plans.append(KvEventsPlan(r, "connect", _reachable(ep, peer_host), replay))
        else:
            plans.append(KvEventsPlan(r, "bind", ep, replay))
    return plans


@dataclass(slots=True)
class SilenceWatch:
    """Flags a KV-event subscription that has received nothing while the engine's KvMetrics show it
    prefilling (KV pages held in a report that arrived after the subscription opened, so it
    must have published `BlockStored` since): the classic cause is both sides connecting (or both
    binding). `observe` returns `waiting` (no evidence yet), `ok` (batches arrive) or `silent`
    (evidence `silence_s` ago and still nothing). Idle engines send nothing and are never flagged."""

    silence_s: float
    busy_since: float | None = None
    state: str = "waiting"

    def observe(self, now: float, batches: int, busy: bool) -> str:
        if batches > 0:
            self.busy_since, self.state = None, "ok"
        elif busy or self.busy_since is not None:
            if self.busy_since is None:
                self.busy_since = now
            self.state = "silent" if now - self.busy_since >= self.silence_s else "waiting"
        return self.state


def shows_prefill(kv_active_tokens: int, page_size: int, received_at: float, opened_at: float,
                  backlog_s: float = 0.5) -> bool:
    """Whether one KvMetrics report is evidence of new cached pages: at least a page held, and the
    report arrived after the subscription opened (`backlog_s` later: a PUSH socket queues frames
    while nobody listens and delivers that old backlog at once)."""
    return kv_active_tokens >= page_size and received_at >= opened_at + backlog_s
