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

What is not: SGLang's transfer engines (Mooncake/NIXL), the KV indices decode sends to prefill, and
decode-side KV pre-allocation. The rendezvous is one loopback HTTP long-poll on the prefill sim's
bootstrap port: `POST /kvroute_sim/rooms/{room}` answers when that room's KV has arrived.
All durations are simulated seconds (× `--time-scale` on the wall clock).
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


def bootstrap_of(body: Any, mode: str) -> Bootstrap:
    """The bootstrap fields of a parsed request body (extra fields of the sim's lenient models).
    Raises MissingBootstrap with SGLang's message when the room is missing, or (decode) the prefill's address."""
    extra = getattr(body, "model_extra", None) or {}
    room, host, port = extra.get("bootstrap_room"), extra.get("bootstrap_host"), extra.get("bootstrap_port")
    if isinstance(room, list) or isinstance(host, list) or isinstance(port, list):
        room, host, port = (v[0] if isinstance(v, list) and len(v) == 1 else v for v in (room, host, port))
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise MissingBootstrap("Invalid request: Disaggregated request received without bootstrap room id.")
    if mode == "decode" and (not isinstance(host, str) or not isinstance(port, int)):
        raise MissingBootstrap("Invalid request: a decode server needs bootstrap_host and bootstrap_port "
                               "(the prefill server's bootstrap address)")
    return Bootstrap(host, port, room)


@dataclass(eq=False)
class _Room:
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    kv: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prefill_attached: bool = False


class PrefillSide:
    """The prefill sim's bootstrap server and rooms."""

    def __init__(self, config: DisaggConfig, host: str, time_scale: float) -> None:
        self.config = config
        self.host = host
        self.time_scale = time_scale
        self.rooms: dict[int, _Room] = {}
        self.transfers = 0
        self.bootstrap_timeouts = 0
        self.recent_rooms: deque[int] = deque(maxlen=64)  # rooms whose KV went out, newest last
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(ROOM_PATH, self._decode_arrives)
        app.router.add_get("/health", lambda _: web.Response(text="OK"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.config.bootstrap_port).start()
        logger.info("bootstrap server on %s:%d", self.host, self.config.bootstrap_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _room(self, room: int) -> _Room:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = _Room()
        return r

    async def _decode_arrives(self, request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
        except ValueError:
            return web.json_response({"error": "room must be an integer"}, status=400)
        try:  # the decode side's own waiting timeout (wall seconds): the handler must not outlive it
            wait_s = min(float(request.query.get("timeout", "3600")), 3600.0)
        except ValueError:
            return web.json_response({"error": "timeout must be a number"}, status=400)
        room = self._room(room_id)
        room.decode_arrived.set()
        try:
            info = await asyncio.wait_for(asyncio.shield(room.kv), timeout=wait_s)
        except asyncio.TimeoutError:
            return web.json_response({"error": f"room {room_id}: no KV within {wait_s:.3f}s"}, status=504)
        except DisaggFailure as exc:
            return web.json_response({"error": str(exc)}, status=500)
        finally:
            if not room.prefill_attached and self.rooms.get(room_id) is room:
                del self.rooms[room_id]
        return web.json_response(info)

    async def hand_over(self, bootstrap: Bootstrap, prompt_tokens: int, uncached_tokens: int,
                        waited_s: float) -> None:
        """After the prefill: wait for the decode peer (the rest of the bootstrap timeout, `waited_s`
        being gone already), transfer the KV, and tell the peer. Raises DisaggFailure on timeout."""
        room = self._room(bootstrap.room)
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
            self.recent_rooms.append(bootstrap.room)
            if not room.kv.done():
                room.kv.set_result({"room": bootstrap.room, "prompt_tokens": prompt_tokens,
                                    "transferred_tokens": uncached_tokens})
        finally:
            if self.rooms.get(bootstrap.room) is room:
                del self.rooms[bootstrap.room]


class DecodeSide:
    """The decode sim's half: fetch a room's KV from the prefill server's bootstrap port."""

    def __init__(self, config: DisaggConfig, time_scale: float) -> None:
        self.config = config
        self.time_scale = time_scale
        self.waiting_timeouts = 0
        self.received = 0
        self.recent_rooms: deque[int] = deque(maxlen=64)  # rooms whose KV came in, newest last
        self._session: aiohttp.ClientSession | None = None

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def receive(self, bootstrap: Bootstrap) -> dict[str, Any]:
        """Wait for the room's KV (SGLang's waiting timeout). Raises DisaggFailure."""
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False)
        c = self.config
        host = f"[{bootstrap.host}]" if bootstrap.host and ":" in bootstrap.host else bootstrap.host
        url = f"http://{host}:{bootstrap.port}" + ROOM_PATH.format(room=bootstrap.room)
        wait_s = c.waiting_timeout_s * self.time_scale
        try:
            async with asyncio.timeout(wait_s):
                async with self._session.post(url, params={"timeout": f"{wait_s:.6f}"}) as r:
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
        return body
