"""The simulated worker process: SGLang's HTTP surface over the engine, driven in scaled real time.

One asyncio loop runs uvicorn, the HTTP routes and `EngineDriver`, which repeatedly asks the
engine for a batch, sleeps for the batch's simulated duration × `time_scale`, and hands the
produced tokens to the waiting requests. KvMetrics go out through `MetricsEmitter`, KV events
through `KvEventPublisher`, both from the engine's report points.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from types import FrameType
from typing import Any

import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sim import protocol, tokenizer
from sim.config import SimConfig
from sim.dp import DpController, Route, requested_rank
from sim.disagg import Bootstrap, DecodeSide, DisaggFailure, MissingBootstrap, PrefillSide, bootstrap_of
from sim.engine import Engine, KvReport, RequestRejected, SimRequest, TokenOutput
from sim.kv_event_publisher import KvEventPublisher
from sim.kv_events import KvEvent
from sim.lora import LoraError, LoraRef, LoraRegistry, parse_lora_paths
from sim.metrics_emitter import MetricsEmitter
from sim.prometheus import CONTENT_TYPE as PROM_CONTENT_TYPE
from sim.prometheus import SimMetrics
from sim.sglang_shapes import SIM_ROUTES, http_routes, release_of

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MAX_LAG_S = 0.05  # wall seconds the driver may fall behind before it stops catching up


def _now_s() -> int:
    return int(time.time())


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


# ------------------------------------------------------------------------------ engine driver


@dataclasses.dataclass(eq=False)
class _Stream:
    req: SimRequest
    queue: asyncio.Queue[TokenOutput]
    wall_submit: float
    wall_first: float | None = None
    done: bool = False
    rank: int = 0  # the attention-DP rank serving it
    pending: asyncio.Future[None] | None = None  # PD decode: its KV is on the way (then `req` is admitted)
    handover: Bootstrap | None = None  # PD prefill: the room its KV goes to once prefilled


class EngineDown(RuntimeError):
    """The engine loop died (a bug): requests get 503 and /health fails, like a hung SGLang."""


class EngineDriver:
    """Runs the engine against the wall clock: sim time = elapsed wall time / time_scale."""

    def __init__(self, engine: Engine, time_scale: float) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self._t0 = time.monotonic()
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.failed: BaseException | None = None

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int, *, prefilled: bool = False,
               stream: _Stream | None = None, lora: LoraRef | None = None) -> _Stream:
        """Queue a request; raises RequestRejected (→ 400) if the engine can never serve it. With
        `stream` (PD decode, once its KV arrived), that stream gets the engine's request."""
        if self.failed is not None:
            raise EngineDown(f"the simulated engine stopped: {self.failed!r}")
        if self._stopping:
            raise RequestRejected("the server is shutting down")
        req = self.engine.submit(rid, input_ids, max_new_tokens, self.sim_now(), prefilled=prefilled,
                                 lora_id=lora.lora_id if lora else None, lora_name=lora.name if lora else None)
        if stream is None:
            stream = _Stream(req=req, queue=asyncio.Queue(), wall_submit=time.monotonic())
        else:
            stream.req = req
        self._streams[rid] = stream
        self._wake.set()
        return stream

    def abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None and not stream.done:
            self.engine.abort(rid, self.sim_now())

    def end_all_streams(self) -> None:
        """On shutdown: every open request ends now (finish_reason "abort")."""
        self._stopping = True
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(TokenOutput(rid, None, -1, True, "abort"))
        self._wake.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("simulated engine loop failed; failing open requests and /health")
            self.failed = exc
            self.end_all_streams()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while not self._stopping:
            batch = self.engine.schedule(self.sim_now())
            if batch is None:
                deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            start = loop.time()
            if deadline is None or deadline < start - _MAX_LAG_S:
                deadline = start
            deadline += batch.duration * self.time_scale
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            for out in self.engine.complete(batch, self.sim_now()):
                stream = self._streams.get(out.rid)
                if stream is None:
                    continue
                if out.finished:
                    stream.done = True
                    del self._streams[out.rid]
                stream.queue.put_nowait(out)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()


class _Outputs:
    """The engine's listener: KvMetrics → PUSH socket, KV events → PUB socket."""

    def __init__(self, emitter: MetricsEmitter | None, publisher: KvEventPublisher | None) -> None:
        self.emitter = emitter
        self.publisher = publisher
        self.last_report: KvReport | None = None

    def on_kv_metrics(self, report: KvReport) -> None:
        self.last_report = report
        if self.emitter is not None:
            self.emitter.send(report)

    def on_kv_events(self, events: list[KvEvent]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)


# ------------------------------------------------------------------------------ the server


class SimServer:
    """Everything one simulated worker owns. Build it, serve `app`, then `close()`.

    Binds the KV event sockets and connects the metrics socket in the constructor, so a bad
    endpoint fails before the HTTP port opens (ValueError naming the endpoint).
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.started_at = time.time()
        self.lora = LoraRegistry(config.lora_enabled, parse_lora_paths(config.lora_paths), config.max_loras_per_batch)
        engine_cfg = config.engine.model_copy(
            update={
                "record_kv_events": config.kv_events_endpoint is not None,
                "round_prefill_usage": config.wire == "0.4.9",
                # held to the real 0.5.23 server (tests/real_engine/test_sim_parity.py)
                "round_usage": config.wire.startswith("0.5.23"),
                "decode_keeps_hit_rate": config.wire.startswith("0.5.23"),
                "max_loras_per_batch": config.max_loras_per_batch if config.lora_enabled else None,
            }
        )
        self._zmq = zmq.Context()
        # one scheduler per attention-DP rank: its own engine (KV pool, loop), KvMetrics PUSH (every
        # rank connects to the one metrics address, as SGLang's DP ranks share theirs) and KV-event
        # PUB on the endpoint offset by its rank; without DP the one rank is --dp-rank
        ranks = [engine_cfg.dp_rank] if config.dp_size == 1 else list(range(config.dp_size))
        self.outputs_by_rank: list[_Outputs] = []
        try:
            for rank in ranks:
                emitter = publisher = None
                if config.metrics_endpoint:
                    emitter = MetricsEmitter(config.metrics_endpoint, config.wire, context=self._zmq)
                self.outputs_by_rank.append(_Outputs(emitter, None))
                if config.kv_events_endpoint:
                    publisher = KvEventPublisher(
                        config.kv_events_endpoint,
                        release=config.wire,
                        bind=config.kv_events_bind,
                        encoding=config.events_encoding,
                        topic=config.kv_events_topic,
                        dp_rank=rank,
                        replay_endpoint=config.kv_events_replay_endpoint,
                        buffer_steps=config.kv_events_buffer_steps,
                        context=self._zmq,
                    )
                    self.outputs_by_rank[-1].publisher = publisher
        except Exception:
            self._close_outputs()
            self._zmq.term()
            raise
        self.engines = [Engine(engine_cfg.model_copy(update={"dp_rank": rank}), out)
                        for rank, out in zip(ranks, self.outputs_by_rank)]
        self.outputs = self.outputs_by_rank[0]  # rank 0's (the only one without DP)
        self.engine = self.engines[0]
        self.dp = DpController(config.dp_size, config.wire)
        self._release = tuple(int(x) for x in release_of(config.wire).split("."))
        self._rank_in_meta = self._release >= (0, 5, 14)
        self.metrics = SimMetrics(config.model_name)
        self.drivers: list[EngineDriver] = []
        self.driver: EngineDriver | None = None  # rank 0's
        self._tasks: list[asyncio.Task[None]] = []
        self.prefill_side: PrefillSide | None = None  # PD roles (sim.disagg), made on the serving loop
        self.decode_side: DecodeSide | None = None
        self.version = release_of(config.wire)  # what /server_info and /v1/loads say the server is
        self.app = _keep_release_routes(self._build_app(), config.wire)

    # -------------------------------------------------------------- lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.drivers = [EngineDriver(e, self.config.time_scale) for e in self.engines]
        self.driver = self.drivers[0]
        self._tasks = [asyncio.create_task(d.run(), name=f"sim-engine-{i}") for i, d in enumerate(self.drivers)]
        pd = self.config.disagg
        if pd is not None and pd.mode == "prefill":
            self.prefill_side = PrefillSide(pd, self.config.host, self.config.time_scale, self.config.dp_size,
                                            self.config.balance_method == "follow_bootstrap_room")
            await self.prefill_side.start()
        elif pd is not None:
            self.decode_side = DecodeSide(pd, self.config.time_scale)
        if any(o.publisher is not None and o.publisher.replay_endpoint for o in self.outputs_by_rank):
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="sim-kv-replay"))
        logger.info(
            "sim worker %s:%d up (model %s, wire %s, metrics → %s, kv events %s)",
            self.config.host, self.config.port, self.config.model_name, self.config.wire,
            self.config.metrics_endpoint, self.config.kv_events_endpoint,
        )
        try:
            yield
        finally:
            for side in (self.prefill_side, self.decode_side):
                if side is not None:
                    await side.stop()
            for d in self.drivers:
                d.stop()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve_replay(self) -> None:
        while True:
            for o in self.outputs_by_rank:
                if o.publisher is not None:
                    o.publisher.serve_replay()
            await asyncio.sleep(0.02)

    def begin_shutdown(self) -> None:
        """Called when a stop signal arrives: open streams end at once instead of timing out."""
        for d in self.drivers:
            d.end_all_streams()

    def _close_outputs(self) -> None:
        for o in self.outputs_by_rank:
            if o.emitter is not None:
                o.emitter.close()
            if o.publisher is not None:
                o.publisher.close()

    def close(self) -> None:
        """Close every socket (linger 0). Idempotent."""
        self._close_outputs()
        if not self._zmq.closed:
            self._zmq.term()

    # -------------------------------------------------------------- shared helpers

    def _driver(self, rank: int = 0) -> EngineDriver:
        if not self.drivers:
            raise RuntimeError("the engine driver is not running (app used outside its lifespan)")
        return self.drivers[rank]

    def _server_args(self) -> dict[str, Any]:
        c, e = self.config, self.engine.config
        kv_cfg = None
        if c.kv_events_endpoint:
            kv_cfg = json.dumps(
                {"publisher": "zmq", "endpoint": c.kv_events_endpoint, "topic": c.kv_events_topic,
                 "replay_endpoint": c.kv_events_replay_endpoint,
                 **({"bind": c.kv_events_bind} if c.kv_events_bind is not None else {})}
            )
        return {
            "model_path": c.model_name,
            "tokenizer_path": c.model_name,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": c.port,
            "page_size": e.page_size,
            "max_total_num_tokens": self.engine.max_total_num_tokens,
            "max_running_requests": e.max_running_requests,
            "max_prefill_tokens": e.max_prefill_tokens,
            "chunked_prefill_size": -1,
            "context_length": e.context_length,
            "schedule_policy": "fcfs",
            "tp_size": 1,
            "dp_size": c.dp_size,
            "enable_dp_attention": c.dp_size > 1,
            "load_balance_method": c.balance_method,  # `auto` resolved, as SGLang reports it
            "decode_log_interval": e.decode_log_interval,
            "enable_metrics": True,
            "kv_events_config": kv_cfg,
            "disaggregation_mode": c.disagg.mode if c.disagg else "null",
            "disaggregation_bootstrap_port": c.disagg.bootstrap_port if c.disagg else 8998,
            "enable_lora": c.lora_enabled,
            "lora_paths": [{"lora_id": r.lora_id, "lora_name": r.name, "lora_path": r.path, "pinned": r.pinned}
                           for r in parse_lora_paths(c.lora_paths)] if c.lora_enabled else None,
            "max_loras_per_batch": c.max_loras_per_batch,
        }

    def _kv_events_info(self) -> dict[str, Any] | None:
        pub = self.outputs.publisher
        if pub is None:
            return None
        info: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint": pub.endpoint,
            "topic": self.config.kv_events_topic,
            "block_size": self.engine.page_size,
            "dp_size": self.config.dp_size,
            "encoding": pub.encoding,
            "pub_binds": pub.binds,
            "next_seq": pub.next_seq,
        }
        if pub.endpoint.startswith("tcp://"):
            host, port = pub.endpoint.removeprefix("tcp://").rsplit(":", 1)
            info["endpoint_host"] = host
            info["endpoint_port_base"] = int(port)
        if pub.replay_endpoint:
            info["replay_endpoint"] = pub.replay_endpoint
            if pub.replay_endpoint.startswith("tcp://"):
                info["replay_endpoint_port_base"] = int(pub.replay_endpoint.rsplit(":", 1)[1])
        return info

    def stats_json(self) -> dict[str, Any]:
        """The sim's own figures for the whole server. With DP: counters (and busy seconds) summed over
        the ranks, fractions and means averaged, `token_usage` recomputed; every rank's own under `ranks`."""
        if self.config.dp_size == 1:
            return self._rank_stats(0)
        ranks = [self._rank_stats(i) for i in range(len(self.engines))]
        out: dict[str, Any] = {}
        for key, value in ranks[0].items():
            if key == "dp_rank" or not isinstance(value, (int, float)) or isinstance(value, bool) or key in (
                    "sim_time_s", "time_scale"):
                out[key] = None if key == "dp_rank" else value
            elif isinstance(value, int) or key.endswith("_busy_s"):
                out[key] = sum(r[key] for r in ranks)
            else:
                out[key] = sum(r[key] for r in ranks) / len(ranks)
        if out.get("max_total_num_tokens"):
            out["token_usage"] = out["used_tokens"] / out["max_total_num_tokens"]
        out["ranks"] = ranks
        return out

    def _rank_stats(self, i: int) -> dict[str, Any]:
        stats = dataclasses.asdict(self.engines[i].stats())
        o = self.outputs_by_rank[i]
        em = o.emitter
        last = o.last_report
        return {
            "dp_rank": self.engines[i].config.dp_rank,
            **stats,
            "sim_time_s": self.driver.sim_now() if self.driver else 0.0,
            "time_scale": self.config.time_scale,
            "wire": self.config.wire,
            "kv_metrics_sent": em.sent if em else 0,
            "kv_metrics_dropped": em.dropped if em else 0,
            "last_kv_metrics": last.as_dict() if last else None,
            "kv_events_published": o.publisher.next_seq if o.publisher else 0,
            "disagg": self._disagg_stats(),
        }

    def _disagg_stats(self) -> dict[str, Any] | None:
        """PD handoffs so far (tests read them): prefill transfers / bootstrap timeouts, decode KV received / waiting timeouts."""
        p, d = self.prefill_side, self.decode_side
        if p is not None:
            return {"mode": "prefill", "transfers": p.transfers, "bootstrap_timeouts": p.bootstrap_timeouts,
                    "open_rooms": len(p.rooms), "recent_rooms": list(p.recent_rooms),
                    "transfers_by_rank": list(p.transfers_by_rank), "recent_ranks": list(p.recent_ranks),
                    "rank_conflicts": p.rank_conflicts}
        if d is not None:
            return {"mode": "decode", "received": d.received, "waiting_timeouts": d.waiting_timeouts,
                    "recent_rooms": list(d.recent_rooms), "recent_prefill_ranks": list(d.recent_prefill_ranks)}
        return None

    def _load_snapshot(self, i: int = 0) -> dict[str, Any]:
        """Rank `i`'s load as SGLang's scheduler publishes it (/v1/loads, /get_load)."""
        engine = self.engines[i]
        s = engine.stats()
        e = engine.config
        total_tokens = s.used_tokens + s.waiting_tokens
        busy = s.prefill_busy_s + s.decode_busy_s
        elapsed = self.driver.sim_now() if self.driver else 0.0
        return {
            "timestamp": time.time(),
            "dp_rank": e.dp_rank,
            "num_running_reqs": s.num_running_reqs,
            "num_waiting_reqs": s.num_waiting_reqs,
            "num_waiting_uncached_tokens": s.waiting_tokens,
            "num_used_tokens": s.used_tokens,
            "num_total_tokens": total_tokens,
            "num_active_tokens": total_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": s.max_total_num_tokens,
            "max_running_requests": e.max_running_requests,
            "token_usage": s.token_usage,
            "gen_throughput": s.generation_tokens_total / elapsed if elapsed > 0 else 0.0,
            "cache_hit_rate": s.last_prefill_cache_hit_rate,
            "utilization": min(1.0, busy / elapsed) if elapsed > 0 else 0.0,
            "total_prefill_uncached_tokens": s.prompt_tokens_total - s.cached_tokens_total,
            "total_prefill_busy_us": int(s.prefill_busy_s * 1e6),
            "decode_moments": None,
        }

    # -------------------------------------------------------------- request execution

    async def _tokens(self, stream: _Stream) -> AsyncIterator[TokenOutput]:
        """The request's outputs as they are produced; aborts it if the consumer goes away. PD: a
        decode request first waits for its KV, a prefill request hands its KV over before it ends
        (both raise DisaggFailure when that fails)."""
        try:
            if stream.pending is not None:
                await stream.pending
            while True:
                out = await stream.queue.get()
                if stream.wall_first is None:
                    stream.wall_first = time.monotonic()
                if out.finished and stream.handover is not None and self.prefill_side is not None \
                        and out.finish_reason != "abort":
                    req = stream.req
                    await self.prefill_side.hand_over(
                        stream.handover, len(req.input_ids), len(req.input_ids) - req.cached_tokens,
                        (time.monotonic() - stream.wall_submit) / self.config.time_scale, stream.rank)
                yield out
                if out.finished:
                    return
        finally:
            if stream.pending is not None and not stream.pending.done():
                stream.pending.cancel()
            if not stream.done:
                self._driver(stream.rank).abort(stream.req.rid)

    def _account(self, stream: _Stream, streaming: bool) -> None:
        req = stream.req
        now = time.monotonic()
        self.metrics.observe_request(
            streaming=streaming,
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            ttft_s=(stream.wall_first - stream.wall_submit) if stream.wall_first else None,
            e2e_s=now - stream.wall_submit,
        )

    def _usage(self, req: SimRequest, details: bool = True) -> dict[str, Any]:
        n_in, n_out = len(req.input_ids), len(req.output_ids)
        usage = {
            "prompt_tokens": n_in,
            "total_tokens": n_in + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
            "reasoning_tokens": 0,
        }
        if details:  # 0.5.23 sends it (null) except in a streamed completion's usage chunk
            usage["completion_tokens_details"] = None
        return usage

    def _meta_info(self, stream: _Stream, finish_reason: str | None) -> dict[str, Any]:
        req = stream.req
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": (
                None if finish_reason is None
                else {"type": finish_reason, "length": len(req.output_ids)} if finish_reason == "length"
                else {"type": finish_reason, "message": "request aborted"}
            ),
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "e2e_latency": time.monotonic() - stream.wall_submit,
            "weight_version": "default",
        }
        if self.config.dp_size > 1 and self._rank_in_meta:  # SGLang >= 0.5.14 names the serving rank
            meta["dp_rank"] = stream.rank
        if req.first_token_time is not None:
            meta["sim"] = {
                "ttft_s": req.ttft,
                "queue_s": (req.admit_time or req.arrival) - req.arrival,
            }
        return meta

    def _submit(self, rid: str | None, input_ids: list[int], max_new_tokens: int, body: Any = None,
                pinned: int | None = None, *, health: bool = False, headers: Any = None,
                lora: LoraRef | None = None) -> _Stream:
        """Start a request. Without PD: on the rank the DP front picks (`pinned`, else its turn). With
        the parsed `body` of a PD server (`--disaggregation-mode`), as that role does it: prefill
        computes one token then hands its KV to the room's decode server; decode waits for the room's
        KV (`sim.disagg`), then decodes it without prefill compute."""
        rid = rid or uuid.uuid4().hex
        pd = self.config.disagg if body is not None else None
        try:
            if pd is None:
                rank = self.dp.choose(pinned, health=health)
                stream = self._driver(rank).submit(rid, input_ids, max_new_tokens, lora=lora)
                stream.rank = rank
                return stream
            bootstrap = bootstrap_of(body, pd.mode, headers, self._release)
            if pd.mode == "prefill":  # like SGLang's prefill server: the prompt, one token, the handover
                rank = self.dp.choose(pinned, room=bootstrap.room,
                                      follow_room=self.config.balance_method == "follow_bootstrap_room")
                assert self.prefill_side is not None
                self.prefill_side.check_rank(bootstrap.room, rank, bootstrap.prefill_dp_rank)
                stream = self._driver(rank).submit(rid, input_ids, min(max_new_tokens, 1), lora=lora)
                stream.rank = rank
                stream.handover = bootstrap
                return stream
            rank = self.dp.choose(pinned)  # the decode rank: pinned, else the controller's turn
            self.engines[rank].check(input_ids, max_new_tokens)
            self.engines[rank].prealloc(rid, len(input_ids), max_new_tokens)  # SGLang's decode prealloc queue
        except RequestRejected as exc:
            raise protocol.BadRequest(str(exc)) from exc
        except MissingBootstrap as exc:
            raise protocol.BadRequest(str(exc)) from None
        placeholder = SimRequest(rid=rid, input_ids=list(input_ids), max_new_tokens=max_new_tokens,
                                 arrival=self._driver().sim_now())
        stream = _Stream(req=placeholder, queue=asyncio.Queue(), wall_submit=time.monotonic(), rank=rank)
        stream.pending = asyncio.ensure_future(self._receive_kv(stream, bootstrap, rid, input_ids, max_new_tokens))
        return stream

    async def _receive_kv(self, stream: _Stream, bootstrap: Bootstrap, rid: str, input_ids: list[int],
                          max_new_tokens: int) -> None:
        assert self.decode_side is not None
        try:
            await self.decode_side.receive(bootstrap)
            self._driver(stream.rank).submit(rid, input_ids, max_new_tokens, prefilled=True, stream=stream)
        except RequestRejected as exc:  # e.g. the rid came into use meanwhile
            self.engines[stream.rank].release_prealloc(rid)
            raise DisaggFailure(str(exc)) from None
        except BaseException:  # no KV (timeout, failed peer) or the client went away: free its pages
            self.engines[stream.rank].release_prealloc(rid)
            raise

    async def _sse_guard(self, pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A PD stream whose KV handoff fails ends with SGLang's error event instead of a reset."""
        try:
            async for piece in pieces:
                yield piece
        except DisaggFailure as exc:
            yield _sse({"error": {"message": str(exc), "type": "InternalServerError", "code": 500}})
            yield _DONE

    def _adapter(self, body: Any, *, openai: bool = True) -> LoraRef | None:
        """The adapter a request runs with (`sim.lora`): `model: "base:adapter"` (chat, completion)
        before `lora_path`; an unknown one is SGLang's 400."""
        try:
            if openai:
                return self.lora.resolve(body.model, body.lora_path, self.config.model_name)
            return self.lora.acquire(body.lora_path)
        except LoraError as exc:
            raise protocol.BadRequest(str(exc)) from None

    def _pinned(self, route: Route, body: Any, request: Request) -> int | None:
        return requested_rank(self.config.wire, route, body, request.headers)

    # -------------------------------------------------------------- routes

    def _build_app(self) -> FastAPI:
        app = FastAPI(lifespan=self._lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        cfg = self.config

        @app.exception_handler(protocol.BadRequest)
        async def _bad_request(request: Request, exc: protocol.BadRequest) -> JSONResponse:
            if request.url.path.startswith("/generate"):
                return JSONResponse({"error": {"message": exc.message}}, status_code=400)
            param = None if getattr(exc, "from_validation", False) else exc.param
            return JSONResponse(protocol.openai_error(exc.message, param), status_code=400)

        @app.exception_handler(RequestValidationError)
        async def _invalid_query(request: Request, exc: RequestValidationError) -> JSONResponse:
            err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
            where = ".".join(str(p) for p in err["loc"])
            return JSONResponse(protocol.openai_error(f"{where}: {err['msg']}", where or None), status_code=400)

        @app.exception_handler(DisaggFailure)
        async def _disagg_failed(request: Request, exc: DisaggFailure) -> JSONResponse:
            if request.url.path.startswith("/generate"):
                return JSONResponse({"error": {"message": str(exc)}}, status_code=500)
            return JSONResponse(protocol.openai_error(str(exc), code=500), status_code=500)

        @app.exception_handler(EngineDown)
        async def _engine_down(request: Request, exc: EngineDown) -> JSONResponse:
            return JSONResponse(protocol.openai_error(str(exc), code=503), status_code=503)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if any(d.failed for d in self.drivers) or not self.drivers else 200)

        @app.get("/health_generate")
        async def health_generate() -> Response:
            stream = self._submit(f"HEALTH_CHECK_{uuid.uuid4().hex}", [tokenizer.BOS], 1, health=True)

            async def drain() -> None:
                async for _ in self._tokens(stream):
                    pass

            try:
                await asyncio.wait_for(drain(), timeout=20)
            except asyncio.TimeoutError:
                return Response(status_code=503)
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{
                    "id": cfg.model_name, "object": "model", "created": int(self.started_at),
                    "owned_by": "sglang", "root": cfg.model_name, "parent": None,
                    "max_model_len": self.engine.config.context_length,
                }, *self.lora.model_cards(cfg.model_name, int(self.started_at))],
            }

        async def _lora_update(request: Request, load: bool) -> JSONResponse:
            try:
                obj = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            need = ("lora_name", "lora_path") if load else ("lora_name",)
            if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in need):
                # (FastAPI's 422 for a body its model refuses)
                return JSONResponse({"detail": [{"type": "missing", "loc": ["body", k], "msg": "Field required"}
                                                for k in need if not isinstance(obj, dict) or k not in obj]
                                     or [{"type": "string_type", "loc": ["body"], "msg": "Input should be a valid string"}]},
                                    status_code=422)
            out = self.lora.load(obj["lora_name"], obj["lora_path"], bool(obj.get("pinned", False))) if load \
                else self.lora.unload(obj["lora_name"])
            return JSONResponse(out, status_code=200 if out["success"] else 400)

        @app.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> JSONResponse:
            return await _lora_update(request, True)

        @app.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> JSONResponse:
            return await _lora_update(request, False)

        async def model_info() -> dict[str, Any]:
            return {
                "model_path": cfg.model_name,
                "served_model_name": cfg.model_name,
                "tokenizer_path": cfg.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }

        async def server_info() -> dict[str, Any]:
            stats = self.engine.stats()
            return {
                **self._server_args(),
                "kv_events": self._kv_events_info(),
                "internal_states": [{
                    "last_gen_throughput": self._load_snapshot()["gen_throughput"],
                    "max_total_num_tokens": self.engine.max_total_num_tokens,
                    "token_usage": stats.token_usage,
                }],
                "version": self.version,
                "frontend": "python",
                "sim": self.stats_json(),
            }

        for path, fn in (("/model_info", model_info), ("/get_model_info", model_info),
                         ("/server_info", server_info), ("/get_server_info", server_info)):
            app.add_api_route(path, fn, methods=["GET"])

        @app.get("/sim/stats")
        async def sim_stats() -> dict[str, Any]:
            return self.stats_json()

        @app.get("/v1/loads")
        async def loads(dp_rank: int | None = None, include: str | None = None, format: str | None = None) -> Any:
            sections = {s.strip() for s in include.split(",")} if include else None
            valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if sections is not None and not sections <= valid:
                raise protocol.BadRequest(
                    f"Invalid include sections: {sorted(sections - valid)}. Valid options: {sorted(valid)}", "include"
                )
            # one entry per rank; a dp_rank filter outside the ranks gives an empty list, as SGLang's does
            snaps = [self._load_snapshot(i) for i in range(len(self.engines))]
            if dp_rank is not None:
                snaps = [snap for snap in snaps if snap["dp_rank"] == dp_rank]
            want = (lambda name: True) if sections is None or "all" in sections else (lambda name: name in sections)
            loads = []
            for snap in snaps:
                load: dict[str, Any] = dict(snap)
                if want("memory"):
                    load["memory"] = {
                        "weight_gb": 14.96, "kv_cache_gb": round(self.engine.max_total_num_tokens * 131072 / 2**30, 3),
                        "graph_gb": 0.5, "token_capacity": self.engine.max_total_num_tokens,
                    }
                if want("queues"):
                    load["queues"] = {"waiting": snap["num_waiting_reqs"], "grammar": 0, "paused": 0,
                                      "retracted": 0, "prealloc_ready": 0}
                if want("disagg"):  # 0.5.23 sends this section on every server ("mode": "null" without PD)
                    load["disaggregation"] = {
                        "mode": self.config.disagg.mode if self.config.disagg else "null",
                        "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                        "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0,
                    }
                loads.append(load)
            if format == "prometheus":
                lines = []
                for load in loads:
                    for key, value in load.items():
                        if key == "dp_rank" or isinstance(value, dict) or not isinstance(value, (int, float)):
                            continue
                        lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="{load["dp_rank"]}"}} {value}']
                return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
            return {
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "version": self.version,
                "accelerator": "NVIDIA H100 80GB HBM3",
                "num_accelerators": 1,
                "loads": loads,
            }

        @app.get("/get_load")
        async def get_load() -> list[dict[str, Any]]:
            # the legacy shape sglang-router's power_of_two reads (`num_tokens`); gone in 0.5.23
            snaps = [self._load_snapshot(i) for i in range(len(self.engines))]
            return [{
                "dp_rank": snap["dp_rank"],
                "num_reqs": snap["num_running_reqs"] + snap["num_waiting_reqs"],
                "num_waiting_reqs": snap["num_waiting_reqs"],
                "num_tokens": snap["num_total_tokens"],
                "num_pending_tokens": snap["num_total_tokens"] - snap["num_used_tokens"],
                "ts_tic": time.perf_counter(),
            } for snap in snaps]

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(self.engine.stats()), media_type=PROM_CONTENT_TYPE)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> Response:
            # broadcast to every rank; refused while any rank has requests (none is flushed then)
            if all(e.is_idle for e in self.engines) and all([e.flush_cache() for e in self.engines]):
                return Response("Cache flushed.\nPlease check backend logs for more details. "
                                "(When there are running or waiting requests, the operation will not be performed.)\n")
            return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = protocol.parse_body(await request.body(), protocol.ChatCompletionRequest)
            max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_new is None:
                max_new = self.engine.config.default_max_new_tokens
            stream = self._submit(body.rid, protocol.chat_input_ids(body), max_new, body, self._pinned("chat", body, request),
                                  headers=request.headers, lora=self._adapter(body))
            model = body.model or cfg.model_name
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(self._sse_guard(self._chat_sse(stream, model, usage)), media_type="text/event-stream",
                                         headers=_SSE_HEADERS)
            finish = "length"
            async for out in self._tokens(stream):
                finish = out.finish_reason or finish
            self._account(stream, streaming=False)
            req = stream.req
            return JSONResponse({
                "id": req.rid, "object": "chat.completion", "created": _now_s(), "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": tokenizer.decode(req.output_ids),
                                "reasoning_content": None, "tool_calls": None},
                    "logprobs": None, "finish_reason": finish, "matched_stop": None,
                }],
                "usage": self._usage(req),
                "metadata": {"weight_version": "default"},
            })

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = protocol.parse_body(await request.body(), protocol.CompletionRequest)
            ids = protocol.completion_input_ids(body)
            stream = self._submit(body.rid, ids, body.max_tokens, body, self._pinned("completion", body, request),
                                  headers=request.headers, lora=self._adapter(body))
            model = body.model or cfg.model_name
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(self._sse_guard(self._completion_sse(stream, model, usage)), media_type="text/event-stream",
                                         headers=_SSE_HEADERS)
            finish = "length"
            async for out in self._tokens(stream):
                finish = out.finish_reason or finish
            self._account(stream, streaming=False)
            req = stream.req
            return JSONResponse({
                "id": req.rid, "object": "text_completion", "created": _now_s(), "model": model,
                "choices": [{"index": 0, "text": tokenizer.decode(req.output_ids), "logprobs": None,
                             "finish_reason": finish, "matched_stop": None}],
                "usage": self._usage(req),
            })

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Response:
            body = protocol.parse_body(await request.body(), protocol.GenerateRequest)
            ids = protocol.generate_input_ids(body)
            sp = body.sampling_params
            max_new = sp.max_new_tokens if sp is not None and sp.max_new_tokens is not None else None
            if max_new is None:
                max_new = self.engine.config.default_max_new_tokens
            stream = self._submit(body.rid, ids, max_new, body, self._pinned("generate", body, request),
                                  headers=request.headers, lora=self._adapter(body, openai=False))
            if body.stream:
                return StreamingResponse(self._sse_guard(self._generate_sse(stream)), media_type="text/event-stream",
                                         headers=_SSE_HEADERS)
            finish: str | None = None
            async for out in self._tokens(stream):
                finish = out.finish_reason or finish
            self._account(stream, streaming=False)
            req = stream.req
            return JSONResponse({
                "text": tokenizer.decode(req.output_ids),
                "output_ids": list(req.output_ids),
                "meta_info": self._meta_info(stream, finish),
            })

        return app

    # -------------------------------------------------------------- SSE bodies

    async def _chat_sse(self, stream: _Stream, model: str, include_usage: bool) -> AsyncIterator[bytes]:
        rid, created = stream.req.rid, _now_s()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return _sse({
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "matched_stop": None}],
                "usage": None,
            })

        finish = "length"
        first = True
        async for out in self._tokens(stream):
            if first:  # like SGLang: the role chunk goes out with the first output, after prefill
                yield chunk({"role": "assistant", "content": ""})
                first = False
            if out.token_id is not None:
                yield chunk({"content": tokenizer.decode_token(out.token_id)})
            if out.finished:
                finish = out.finish_reason or finish
        yield chunk({}, finish)
        self._account(stream, streaming=True)
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": self._usage(stream.req)})
        yield _DONE

    async def _completion_sse(self, stream: _Stream, model: str, include_usage: bool) -> AsyncIterator[bytes]:
        rid, created = stream.req.rid, _now_s()

        def chunk(text: str, finish: str | None = None) -> bytes:
            return _sse({
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "matched_stop": None}],
                "usage": None,
            })

        finish = "length"
        ended = False
        async for out in self._tokens(stream):
            if out.finished:
                finish = out.finish_reason or finish
            if out.token_id is not None:  # like 0.5.23: the last token's chunk carries finish_reason
                yield chunk(tokenizer.decode_token(out.token_id), finish if out.finished else None)
                ended = ended or out.finished
        if not ended:
            yield chunk("", finish)
        self._account(stream, streaming=True)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": self._usage(stream.req, details=False)})
        yield _DONE

    async def _generate_sse(self, stream: _Stream) -> AsyncIterator[bytes]:
        text = ""
        async for out in self._tokens(stream):
            req = stream.req  # PD decode: the engine's request exists once the KV is in
            if out.token_id is not None:
                text += tokenizer.decode_token(out.token_id)
            yield _sse({
                "text": text,
                "output_ids": list(req.output_ids),
                "meta_info": self._meta_info(stream, out.finish_reason if out.finished else None),
            })
        self._account(stream, streaming=True)
        yield _DONE


def _keep_release_routes(app: FastAPI, wire: str) -> FastAPI:
    """Leave exactly the routes the claimed release has (`sim.sglang_shapes.HTTP_ROUTES`, the one
    table) plus the sim's own; every other path then gets FastAPI's 404 {"detail": "Not Found"},
    as from SGLang's app. Fails if a handler and the table disagree (path or methods)."""
    from fastapi.routing import APIRoute

    want = {**http_routes(wire), **SIM_ROUTES}
    have: dict[str, frozenset[str]] = {}
    kept = []
    for route in app.router.routes:
        if not isinstance(route, APIRoute):
            kept.append(route)
            continue
        have[route.path] = have.get(route.path, frozenset()) | frozenset(route.methods)
        if route.path in want:
            kept.append(route)
    missing = {p: m for p, m in want.items() if have.get(p) != m}
    if missing:
        raise RuntimeError(f"sim handlers disagree with the route table for {wire}: {missing} (have {have})")
    app.router.routes[:] = kept
    return app


# ------------------------------------------------------------------------------ running it


class _Uvicorn(uvicorn.Server):
    """uvicorn that ends open streams as soon as a stop signal arrives (exit within ~1 s)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_exit)


def serve(config: SimConfig, *, log_level: str = "warning") -> None:
    """Run one simulated worker until SIGTERM/SIGINT; sockets are closed before returning.

    uvicorn logs at `error` unless `log_level` is info/debug: its warnings are about clients
    (e.g. a router probing for HTTP/2 or gRPC), not about this worker.
    """
    server = SimServer(config)

    def _exit_quietly(signum: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the stop signal after its shutdown; end with status 0 instead of a
        # KeyboardInterrupt traceback or death by SIGTERM.
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, _exit_quietly) for sig in (signal.SIGTERM, signal.SIGINT)}
    uv_config = uvicorn.Config(
        server.app,
        host=config.host,
        port=config.port,
        log_level=log_level if log_level in ("debug", "info") else "error",
        access_log=log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=config.shutdown_grace_s,  # type: ignore[arg-type]
    )
    try:
        _Uvicorn(uv_config, server.begin_shutdown).run()
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
