"""SGLang's prefill/decode disaggregation, modelled for the sim: bootstrap rendezvous per room, KV transfer time, timeouts.

What is modelled (SGLang 0.5.23, `srt/disaggregation/`; see docs/pd.md): a request in PD mode must
carry a `bootstrap_room` (else 400, as SGLang's scheduler refuses it). The **prefill** server
prefills the prompt (one output token, like SGLang's prefill which finishes with length 0), waits
until the decode server of the same room has bootstrapped with it (SGLang:
SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, default 300 s — then the request fails with 500), then
transfers the KV: `transfer_base_s + transfer_per_token_s × uncached prompt tokens` (the cached
prefix goes out early, while the prefill computes — SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX),
and answers when the transfer is done. The **decode** server asks the prefill server's bootstrap
port (`bootstrap_host`:`bootstrap_port` of the request) for its room's KV and waits
(SGLANG_DISAGGREGATION_WAITING_TIMEOUT, default 300 s — then the request fails: 500, or an SSE
error event on a stream), then decodes the request from that KV with no prefill compute.

With attention-DP ranks (`--dp-size N`, SGLang 0.5.14+ semantics, `srt/disaggregation/common/conn.py`,
`decode.py`): the prefill server's rank of a request is the pinned `routed_dp_rank`, else (its default
`--load-balance-method`, `follow_bootstrap_room`) `bootstrap_room % N`. Under `follow_bootstrap_room` a
request pinned to another rank fails at once ("follow_bootstrap_room conflict") unless it carries
`disagg_prefill_dp_rank`; under another method the rank registers the room with its bootstrap server
(`/register_dp_rank`). The decode server finds the prefill rank holding a room's KV as SGLang's
`_resolve_prefill_dp_rank` does: `disagg_prefill_dp_rank` if the request has it, else 0 for a prefill
server without DP, else `bootstrap_room % prefill dp_size` if that server follows the room, else it
asks the bootstrap server (`/query_dp_ranks`) until the room is registered. The KV is handed over per
(prefill rank, room): a decode side that looks on the wrong rank waits out its waiting timeout while
the prefill side waits out its bootstrap timeout, as SGLang's would.

The decode side preallocates the prompt's KV pages on arrival (SGLang's decode prealloc queue;
`Engine.prealloc`), so its KvMetrics count requests waiting for their KV.

What is not: SGLang's transfer engines (Mooncake/NIXL), the KV indices decode sends to prefill, and
the prealloc queue's wait when the decode pool is full. The rendezvous is one loopback HTTP long-poll on the prefill sim's
bootstrap port: `POST /kvroute_sim/rooms/{room}?rank=R` answers when that room's KV has arrived from
prefill rank R; `GET /kvroute_sim/info` tells a decode sim the prefill server's dp_size and whether it
follows the room. All durations are simulated seconds (× `--time-scale` on the wall clock).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ROOM_PATH = "/kvroute_sim/rooms/{room}"
INFO_PATH = "/kvroute_sim/info"
PREFILL_RANK_FIELD = "disagg_prefill_dp_rank"
PREFILL_RANK_HEADER = "x-override-disagg-prefill-dp-rank"  # SGLang 0.5.23 (entrypoints/request_headers.py)
_QUERY_INTERVAL_S = 0.005  # how often a decode side asks /query_dp_ranks for a room not registered yet (sim s)


def _env_s(name: str, default: float) -> float:
    """SGLang reads its PD timeouts from the environment; the sim's defaults do too."""
    raw = os.environ.get(name)
    return float(raw) if raw else default


class DisaggConfig(BaseModel):
    """One sim's PD role and the numbers of its KV handoff."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["prefill", "decode"] = Field(description="SGLang's --disaggregation-mode")
    bootstrap_port: int = Field(8998, ge=1, le=65535, description="prefill: where its bootstrap server listens "
                                "(SGLang's --disaggregation-bootstrap-port, default 8998)")
    transfer_base_s: float = Field(0.001, ge=0, description="fixed cost of one request's KV transfer")
    transfer_per_token_s: float = Field(
        5e-6, ge=0, description="transfer cost per uncached prompt token: Llama-3.1-8B holds 128 KiB of KV per "
        "token; at ~25 GB/s of RDMA that is ~5 µs")
    bootstrap_timeout_s: float = Field(
        default_factory=lambda: _env_s("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0), gt=0,
        description="prefill: how long a prefilled request waits for its decode peer (SGLang's "
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, default 300)")
    waiting_timeout_s: float = Field(
        default_factory=lambda: _env_s("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0), gt=0,
        description="decode: how long a request waits for its KV (SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT, "
        "default 300)")


class DisaggFailure(RuntimeError):
    """The KV handoff of one request failed (timeout, unreachable peer): SGLang aborts it with 500."""


class MissingBootstrap(ValueError):
    """A request without the bootstrap fields its PD role needs (→ 400, as SGLang's scheduler)."""


@dataclass(frozen=True)
class Bootstrap:
    host: str | None
    port: int | None
    room: int
    prefill_dp_rank: int | None = None  # `disagg_prefill_dp_rank`: the prefill rank holding the KV


def bootstrap_of(body: Any, mode: str, headers: Any = None, release: tuple[int, ...] = (0, 5, 23)) -> Bootstrap:
    """The bootstrap fields of a parsed request body (extra fields of the sim's lenient models), and
    `disagg_prefill_dp_rank` (body, or from 0.5.23 the header that overrides it). Raises
    MissingBootstrap with SGLang's message when the room is missing, or (decode) the prefill's address."""
    extra = getattr(body, "model_extra", None) or {}
    room, host, port = extra.get("bootstrap_room"), extra.get("bootstrap_host"), extra.get("bootstrap_port")
    if isinstance(room, list) or isinstance(host, list) or isinstance(port, list):
        room, host, port = (v[0] if isinstance(v, list) and len(v) == 1 else v for v in (room, host, port))
    prank = extra.get(PREFILL_RANK_FIELD) if release >= (0, 5, 14) else None
    raw = headers.get(PREFILL_RANK_HEADER) if headers is not None and release >= (0, 5, 23) else None
    if raw is not None:
        try:
            prank = int(raw)
        except ValueError as exc:
            raise MissingBootstrap(f"invalid {PREFILL_RANK_HEADER} header {raw!r}: {exc}") from None
    if prank is not None and (not isinstance(prank, int) or isinstance(prank, bool) or prank < 0):
        raise MissingBootstrap(f"{PREFILL_RANK_FIELD} must be a non-negative integer, got {prank!r}")
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise MissingBootstrap("Invalid request: Disaggregated request received without bootstrap room id.")
    if mode == "decode" and (not isinstance(host, str) or not isinstance(port, int)):
        raise MissingBootstrap("Invalid request: a decode server needs bootstrap_host and bootstrap_port "
                               "(the prefill server's bootstrap address)")
    return Bootstrap(host, port, room, prank)


@dataclass(eq=False)
class _Room:
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    kv: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prefill_attached: bool = False


class PrefillSide:
    """The prefill sim's bootstrap server and rooms."""

    def __init__(self, config: DisaggConfig, host: str, time_scale: float, dp_size: int = 1,
                 follow_bootstrap_room: bool = True) -> None:
        self.config = config
        self.host = host
        self.time_scale = time_scale
        self.dp_size = dp_size
        self.follow_bootstrap_room = follow_bootstrap_room
        self.rooms: dict[tuple[int, int], _Room] = {}  # (prefill rank, room) → its rendezvous
        self.room_ranks: dict[int, int] = {}  # the bootstrap server's /register_dp_rank table
        self.transfers = 0
        self.transfers_by_rank = [0] * dp_size
        self.bootstrap_timeouts = 0
        self.rank_conflicts = 0
        self.recent_rooms: deque[int] = deque(maxlen=64)  # rooms whose KV went out, newest last
        self.recent_ranks: deque[int] = deque(maxlen=64)  # the prefill rank of each, in step
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(ROOM_PATH, self._decode_arrives)
        app.router.add_get(INFO_PATH, self._info)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", lambda _: web.Response(text="OK"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.config.bootstrap_port).start()
        logger.info("bootstrap server on %s:%d", self.host, self.config.bootstrap_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _room(self, key: tuple[int, int]) -> _Room:
        r = self.rooms.get(key)
        if r is None:
            r = self.rooms[key] = _Room()
        return r

    def register(self, room: int, rank: int) -> None:
        """A prefill rank took `room` without following the room (SGLang's `_register_prefill_dp_rank`,
        an HTTP POST to its own bootstrap server; the same table here, in-process)."""
        self.room_ranks[room] = rank
        if len(self.room_ranks) > 65536:  # SGLang expires entries after a while; oldest first here
            del self.room_ranks[next(iter(self.room_ranks))]

    def check_rank(self, room: int, rank: int, pinned_prefill_rank: int | None) -> None:
        """SGLang's CommonKVSender: on a DP prefill server that follows the room, a request routed to
        another rank than `room % dp_size` fails unless it names its prefill rank; otherwise an
        unnamed rank is registered for the decode side to query. Raises DisaggFailure."""
        if self.dp_size <= 1 or pinned_prefill_rank is not None:
            return
        if not self.follow_bootstrap_room:
            self.register(room, rank)
        elif rank != room % self.dp_size:
            self.rank_conflicts += 1
            raise DisaggFailure(f"follow_bootstrap_room conflict: dispatched to dp_rank {rank} but bootstrap_room "
                                f"{room} implies dp_rank {room % self.dp_size}. Set "
                                f"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({"dp_size": self.dp_size, "follow_bootstrap_room": self.follow_bootstrap_room})

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        data = await request.json()
        self.register(int(data["bootstrap_room"]), int(data["dp_rank"]))
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        rooms = (await request.json())["bootstrap_rooms"]
        return web.json_response({str(int(r)): self.room_ranks[int(r)] for r in rooms if int(r) in self.room_ranks})

    async def _decode_arrives(self, request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
            rank = int(request.query.get("rank", "0"))
        except ValueError:
            return web.json_response({"error": "room and rank must be integers"}, status=400)
        if not 0 <= rank < self.dp_size:  # SGLang's bootstrap server: no such rank registered
            return web.json_response({"error": f"prefill dp_rank {rank} out of range [0, {self.dp_size})"}, status=404)
        try:  # the decode side's own waiting timeout (wall seconds): the handler must not outlive it
            wait_s = min(float(request.query.get("timeout", "3600")), 3600.0)
        except ValueError:
            return web.json_response({"error": "timeout must be a number"}, status=400)
        key = (rank, room_id)
        room = self._room(key)
        room.decode_arrived.set()
        try:
            info = await asyncio.wait_for(asyncio.shield(room.kv), timeout=wait_s)
        except asyncio.TimeoutError:
            return web.json_response({"error": f"room {room_id}: no KV within {wait_s:.3f}s"}, status=504)
        except DisaggFailure as exc:
            return web.json_response({"error": str(exc)}, status=500)
        finally:
            if not room.prefill_attached and self.rooms.get(key) is room:
                del self.rooms[key]
        return web.json_response(info)

    async def hand_over(self, bootstrap: Bootstrap, prompt_tokens: int, uncached_tokens: int,
                        waited_s: float, rank: int = 0) -> None:
        """After the prefill on `rank`: wait for the decode peer (the rest of the bootstrap timeout,
        `waited_s` being gone already), transfer the KV, and tell the peer. Raises DisaggFailure on timeout."""
        key = (rank, bootstrap.room)
        room = self._room(key)
        room.prefill_attached = True
        c = self.config
        try:
            left = max(0.0, c.bootstrap_timeout_s - waited_s) * self.time_scale
            try:
                await asyncio.wait_for(room.decode_arrived.wait(), timeout=left)
            except asyncio.TimeoutError:
                self.bootstrap_timeouts += 1
                exc = DisaggFailure(f"Request {bootstrap.room} timed out after {c.bootstrap_timeout_s:.1f}s in "
                                    f"KVPoll.Bootstrapping (no decode server bootstrapped this room; "
                                    f"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
                if not room.kv.done():
                    room.kv.set_exception(exc)
                    room.kv.exception()  # retrieved: no "never retrieved" warning if no peer ever asks
                raise exc from None
            await asyncio.sleep((c.transfer_base_s + c.transfer_per_token_s * uncached_tokens) * self.time_scale)
            self.transfers += 1
            self.transfers_by_rank[rank] += 1
            self.recent_rooms.append(bootstrap.room)
            self.recent_ranks.append(rank)
            if not room.kv.done():
                room.kv.set_result({"room": bootstrap.room, "prompt_tokens": prompt_tokens,
                                    "transferred_tokens": uncached_tokens})
        finally:
            if self.rooms.get(key) is room:
                del self.rooms[key]


class DecodeSide:
    """The decode sim's half: fetch a room's KV from the prefill server's bootstrap port."""

    def __init__(self, config: DisaggConfig, time_scale: float) -> None:
        self.config = config
        self.time_scale = time_scale
        self.waiting_timeouts = 0
        self.received = 0
        self.recent_rooms: deque[int] = deque(maxlen=64)  # rooms whose KV came in, newest last
        self.recent_prefill_ranks: deque[int] = deque(maxlen=64)  # the prefill rank each came from, in step
        self._session: aiohttp.ClientSession | None = None
        self._prefill_info: dict[str, dict[str, Any]] = {}  # bootstrap address → its dp_size, follow_bootstrap_room

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _prefill_rank(self, base: str, bootstrap: Bootstrap) -> int:
        """SGLang's `_resolve_prefill_dp_rank`: the request's `disagg_prefill_dp_rank`, else 0 (prefill
        without DP), else `room % dp_size` (a prefill that follows the room), else the bootstrap
        server's registration of the room, asked until it is there."""
        if bootstrap.prefill_dp_rank is not None:
            return bootstrap.prefill_dp_rank
        assert self._session is not None
        info = self._prefill_info.get(base)
        if info is None:
            async with self._session.get(base + INFO_PATH) as r:
                info = self._prefill_info[base] = await r.json(content_type=None)
        if info["dp_size"] <= 1:
            return 0
        if info["follow_bootstrap_room"]:
            return bootstrap.room % info["dp_size"]
        while True:
            async with self._session.post(base + "/query_dp_ranks", json={"bootstrap_rooms": [bootstrap.room]}) as r:
                found = (await r.json(content_type=None)).get(str(bootstrap.room))
            if found is not None:
                return int(found)
            await asyncio.sleep(_QUERY_INTERVAL_S * self.time_scale)

    async def receive(self, bootstrap: Bootstrap) -> dict[str, Any]:
        """Wait for the room's KV (SGLang's waiting timeout), from the prefill rank that holds it.
        Raises DisaggFailure."""
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False)
        c = self.config
        host = f"[{bootstrap.host}]" if bootstrap.host and ":" in bootstrap.host else bootstrap.host
        base = f"http://{host}:{bootstrap.port}"
        url = base + ROOM_PATH.format(room=bootstrap.room)
        wait_s = c.waiting_timeout_s * self.time_scale
        try:
            async with asyncio.timeout(wait_s):
                prank = await self._prefill_rank(base, bootstrap)
                async with self._session.post(url, params={"timeout": f"{wait_s:.6f}", "rank": str(prank)}) as r:
                    body = await r.json(content_type=None)
                    if r.status == 504:
                        raise TimeoutError
                    if r.status != 200:
                        raise DisaggFailure(f"Request {bootstrap.room}: the prefill server failed it: "
                                            f"{body.get('error', r.status)}")
        except TimeoutError:
            self.waiting_timeouts += 1
            raise DisaggFailure(f"Request {bootstrap.room} timed out after {c.waiting_timeout_s:.1f}s in "
                                f"KVPoll.WaitingForInput (no KV from the prefill server at {bootstrap.host}:"
                                f"{bootstrap.port}; SGLANG_DISAGGREGATION_WAITING_TIMEOUT)") from None
        except aiohttp.ClientError as exc:
            raise DisaggFailure(f"Request {bootstrap.room}: cannot reach the bootstrap server "
                                f"{bootstrap.host}:{bootstrap.port} ({type(exc).__name__})") from None
        self.received += 1
        self.recent_rooms.append(bootstrap.room)
        self.recent_prefill_ranks.append(prank)
        return body
