"""A simulated `sglang.Engine` for Ray Serve LLM's `SGLangServer`: the same calls the server makes
(`async_generate`, `tokenizer_manager.tokenizer`, `shutdown`), answered by kvroute's simulated
scheduler (`sim.engine`) in scaled real time, with KvMetrics pushed to the engine's metrics
address exactly as SGLang's scheduler sends them. Everything above the engine stays Ray's code.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq

from sim import tokenizer
from sim.config import EngineConfig
from sim.engine import Engine, KvReport, RequestRejected
from sim.kv_events import KvEvent
from sim.metrics_emitter import MetricsEmitter
from sim.server import EngineDriver
from sim.sglang_shapes import DEFAULT_WIRE


class _TokenizerManager:
    # SGLang's --skip-tokenizer-init shape: SGLangServer then renders chat prompts as "role: content"
    tokenizer = None


class _Listener:
    def __init__(self, emitter: MetricsEmitter) -> None:
        self.emitter = emitter
        self.reports = 0

    def on_kv_metrics(self, report: KvReport) -> None:
        self.reports += 1
        self.emitter.send(report)

    def on_kv_events(self, events: list[KvEvent]) -> None:  # exact mode is not wired for Serve LLM
        pass


class SimSGLangEngine:
    """`SimSGLangEngine(metrics_ipc_name=..., time_scale=..., **EngineConfig fields such as page_size)`.

    Must be built inside a running event loop (the replica's): the scheduler loop is a task on it."""

    def __init__(self, *, metrics_ipc_name: str, time_scale: float = 1.0, wire: str = DEFAULT_WIRE,
                 rid_prefix: str = "", **engine_fields: Any) -> None:
        self.rid_prefix = rid_prefix  # request ids (the response's `id`) start with it: tests see the replica
        self.config = EngineConfig(**engine_fields)
        self._zmq = zmq.Context()
        self._listener = _Listener(MetricsEmitter(metrics_ipc_name, wire, context=self._zmq))
        self.engine = Engine(self.config, self._listener)
        self.driver = EngineDriver(self.engine, time_scale)
        self.tokenizer_manager = _TokenizerManager()
        self.metrics_ipc_name = metrics_ipc_name
        self._task = asyncio.get_running_loop().create_task(self.driver.run(), name="sim-sglang-engine")

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
        ids = tokenizer.encode(prompt, add_bos=True)
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
        self._listener.emitter.close()
        self._zmq.term()
