"""A simulated `sglang.Engine` for Ray Serve LLM's `SGLangServer`: the same calls the server makes
(`async_generate`, `tokenizer_manager.tokenizer`, `shutdown`), answered by kvroute's simulated
scheduler (`sim.engine`) in scaled real time, with KvMetrics pushed to the engine's metrics
address exactly as SGLang's scheduler sends them and (given SGLang's `kv_events_config`) KV events
published as the simulated SGLang server publishes them (`sim.kv_event_publisher`). Everything
above the engine stays Ray's code.

Its tokenizer is the simulator's in a Hugging Face tokenizer's shape (`chat_render.SimChatTokenizer`):
`SGLangServer` renders chat prompts to text with it and the engine tokenizes that text as SGLang's
TokenizerManager does — the path a real engine behind Ray Serve LLM takes, which kvroute's request
router reproduces in exact prefix mode (`chat_render.rendered_chat_ids`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import zmq

from serve_app.ray_llm.chat_render import SimChatTokenizer
from sim import tokenizer
from sim.config import EngineConfig
from sim.engine import Engine, KvReport, RequestRejected
from sim.kv_event_publisher import KvEventPublisher
from sim.kv_events import KvEvent
from sim.metrics_emitter import MetricsEmitter
from sim.server import EngineDriver
from sim.sglang_shapes import DEFAULT_WIRE, release_of


class _TokenizerManager:
    def __init__(self) -> None:
        self.tokenizer = SimChatTokenizer()


class _Listener:
    def __init__(self, emitter: MetricsEmitter, publisher: KvEventPublisher | None) -> None:
        self.emitter = emitter
        self.publisher = publisher
        self.reports = 0

    def on_kv_metrics(self, report: KvReport) -> None:
        self.reports += 1
        self.emitter.send(report)

    def on_kv_events(self, events: list[KvEvent]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)


def kv_event_publisher(kv_events_config: str | Mapping[str, Any], wire: str, context: zmq.Context) -> KvEventPublisher:
    """SGLang's `kv_events_config` (its JSON, or the parsed dict) → the sim's publisher for `wire`'s
    release. Raises ValueError for a publisher other than zmq or a malformed config."""
    cfg = json.loads(kv_events_config) if isinstance(kv_events_config, str) else dict(kv_events_config)
    if not isinstance(cfg, dict) or cfg.get("publisher", "null") != "zmq":
        raise ValueError(f"kv_events_config: only the zmq publisher is simulated, got {cfg!r:.200}")
    release = release_of(wire)
    rel = tuple(int(x) for x in release.split("."))
    return KvEventPublisher(
        cfg.get("endpoint", "tcp://*:5557"), release=release, bind=cfg.get("bind"),
        encoding="map" if rel >= (0, 5, 20) else "array", topic=cfg.get("topic", ""),
        replay_endpoint=cfg.get("replay_endpoint"), buffer_steps=int(cfg.get("buffer_steps", 10_000)),
        hwm=int(cfg.get("hwm", 100_000)), context=context)


class SimSGLangEngine:
    """`SimSGLangEngine(metrics_ipc_name=..., time_scale=..., kv_events_config=..., **EngineConfig fields
    such as page_size)`; `kv_events_config` is SGLang's (JSON or dict; None: no KV events).

    Must be built inside a running event loop (the replica's): the scheduler loop is a task on it."""

    def __init__(self, *, metrics_ipc_name: str, time_scale: float = 1.0, wire: str = DEFAULT_WIRE,
                 rid_prefix: str = "", kv_events_config: str | Mapping[str, Any] | None = None,
                 **engine_fields: Any) -> None:
        self.rid_prefix = rid_prefix  # request ids (the response's `id`) start with it: tests see the replica
        self._zmq = zmq.Context()
        publisher = None
        if kv_events_config is not None:
            try:
                publisher = kv_event_publisher(kv_events_config, wire, self._zmq)
            except BaseException:
                self._zmq.term()
                raise
            engine_fields = {**engine_fields, "record_kv_events": True}
        self.config = EngineConfig(**engine_fields)
        self._listener = _Listener(MetricsEmitter(metrics_ipc_name, wire, context=self._zmq), publisher)
        self.engine = Engine(self.config, self._listener)
        self.driver = EngineDriver(self.engine, time_scale)
        self.tokenizer_manager = _TokenizerManager()
        self.metrics_ipc_name = metrics_ipc_name
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self.driver.run(), name="sim-sglang-engine")
        self._replay = loop.create_task(self._serve_replay(publisher)) if publisher and publisher.replay_endpoint \
            else None

    @property
    def kv_events(self) -> KvEventPublisher | None:
        return self._listener.publisher

    @staticmethod
    async def _serve_replay(publisher: KvEventPublisher) -> None:
        while True:  # as the sim server does: the replay ROUTER answers within ~20 ms
            publisher.serve_replay()
            await asyncio.sleep(0.02)

    @property
    def alive(self) -> bool:
        return not self._task.done() and self.driver.failed is None

    async def async_generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                             stream: bool = False, **_: Any) -> Any:
        """SGLang's `Engine.async_generate`: a dict (a list for a list of prompts), or with
        `stream=True` an async iterator of dicts whose `text` is cumulative."""
        sp = sampling_params or {}
        max_new = sp.get("max_new_tokens")
        if max_new is None:
            max_new = self.config.default_max_new_tokens
        if isinstance(prompt, list):
            if stream:
                raise ValueError("streaming a list of prompts is not supported (SGLang neither)")
            return list(await asyncio.gather(*(self._one(p, max_new) for p in prompt)))
        if stream:
            return self._stream(prompt, max_new)
        return await self._one(prompt, max_new)

    def _submit(self, prompt: str, max_new: int) -> Any:
        ids = self.tokenizer_manager.tokenizer.encode(prompt)
        try:
            return self.driver.submit(f"{self.rid_prefix}{uuid.uuid4().hex}", ids, int(max_new))
        except RequestRejected as exc:
            raise ValueError(str(exc)) from exc

    async def _outputs(self, st: Any) -> AsyncIterator[Any]:
        try:
            while True:
                out = await st.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if not st.done:
                self.driver.abort(st.req.rid)

    def _payload(self, st: Any, finish: str | None) -> dict[str, Any]:
        req = st.req
        return {
            "text": tokenizer.decode(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "finish_reason": None if finish is None else {"type": finish},
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
            },
        }

    async def _one(self, prompt: str, max_new: int) -> dict[str, Any]:
        st = self._submit(prompt, max_new)
        finish = "length"
        async for out in self._outputs(st):
            finish = out.finish_reason or finish
        return self._payload(st, finish)

    async def _stream(self, prompt: str, max_new: int) -> AsyncIterator[dict[str, Any]]:
        st = self._submit(prompt, max_new)
        async for out in self._outputs(st):
            yield self._payload(st, (out.finish_reason or "length") if out.finished else None)

    def shutdown(self) -> None:
        self.driver.end_all_streams()
        self.driver.stop()
        self._task.cancel()
        if self._replay is not None:
            self._replay.cancel()
        self._listener.emitter.close()
        if self._listener.publisher is not None:
            self._listener.publisher.close()
        self._zmq.term()
