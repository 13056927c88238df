"""What differs between the SGLang releases the contract lane runs (kvroute never imports sglang;
only these tests do). Facts from the released sources; the one stub is the parallel topology."""

from __future__ import annotations

import dataclasses
import importlib
import re
from types import SimpleNamespace
from typing import Any

import pytest

sglang = pytest.importorskip("sglang", reason="the SGLang contract lane runs in scripts/sglang_env.sh's venv")

RELEASE = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", sglang.__version__).groups())

# The parallel-topology lookup: on a GPU server the scheduler learns its ranks from torch.distributed.
# Here one engine, no TP/PP/DP: every rank 0. This is the only SGLang part the lane replaces.
TOPOLOGY = SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, attn_dp_size=1,
                           dp_rank=0, tp_rank=0, tp_size=1)


def kv_events_module() -> Any:
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def has_kv_metrics_publisher() -> bool:
    """Releases whose KvMetrics module imports next to torch 2.13 (0.5.14+: older ones call
    `torch._C._cpu._is_amx_tile_supported`, removed from torch, when `sglang.srt.utils` loads)."""
    return RELEASE >= (0, 5, 14)


def scheduler_kv_publisher(monkeypatch: pytest.MonkeyPatch, *, kv_events_config: str, sock: Any,
                           max_running_requests: int, max_total_num_tokens: int, get_stats: Any,
                           tree_cache: Any = None) -> Any:
    """SGLang's `SchedulerKvEventsPublisher` (the scheduler's KvMetrics + KV-event publisher)."""
    mod = importlib.import_module("sglang.srt.managers.scheduler_components.kv_events_publisher")
    cls = mod.SchedulerKvEventsPublisher
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = dict(kv_events_config=kv_events_config, tree_cache=tree_cache,
                                  send_metrics_from_scheduler=sock, max_running_requests=max_running_requests,
                                  max_total_num_tokens=max_total_num_tokens, get_stats=get_stats)
    if "ps" in names:  # 0.5.14: the scheduler passes its ParallelState and ranks in
        kwargs.update(ps=TOPOLOGY, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0)
    else:  # 0.5.16+: looked up from the runtime context
        for m in (mod, kv_events_module()):
            if hasattr(m, "get_parallel"):
                monkeypatch.setattr(m, "get_parallel", lambda: TOPOLOGY)
    return cls(**{k: v for k, v in kwargs.items() if k in names})


class _Allocator:
    """The KV pool the radix cache frees into; SGLang's own `create_simulated` takes a mock one."""

    device = "cpu"

    def free(self, *args: Any, **kwargs: Any) -> None:
        pass

    def free_segment(self, *args: Any, **kwargs: Any) -> None:
        pass


class EventSource:
    """SGLang's radix cache recording KV events (where it imports here), else SGLang's own event
    classes filled in as the 0.4.9 radix cache fills them (hashes: SGLang's sha256 chain)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.ke = kv_events_module()
        self._pending: list[Any] = []
        self._held: list[list[int]] = []
        try:
            rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            bpc = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
            self.cache = rc.RadixCache.create_simulated(page_size=page_size, enable_kv_cache_events=True,
                                                        mock_allocator=_Allocator())
            self._rc, self._bpc = rc, bpc
            self.cache.take_events()  # the AllBlocksCleared of its own reset()
        except (ImportError, AttributeError):
            self.cache = None

    @property
    def real_cache(self) -> bool:
        return self.cache is not None

    def insert(self, token_ids: list[int]) -> None:
        if self.cache is not None:
            self.cache.insert(self._bpc.InsertParams(key=self._rc.RadixKey(list(token_ids))))
            return
        from sim.kv_events import block_hashes

        n = len(token_ids) // self.page_size * self.page_size
        hashes = block_hashes(token_ids[:n], self.page_size)
        self._pending.append(self.ke.BlockStored(block_hashes=hashes, parent_block_hash=None,
                                                 token_ids=list(token_ids[:n]), block_size=self.page_size,
                                                 lora_id=None))
        self._held.append(hashes)

    def evict_last(self) -> None:
        """Evict one leaf page (the radix cache picks it); without the cache, the last stored one."""
        if self.cache is not None:
            self.cache.evict(self._bpc.EvictParams(num_tokens=self.page_size))
            return
        last = self._held[-1].pop()
        self._pending.append(self.ke.BlockRemoved(block_hashes=[last]))

    def clear(self) -> None:
        if self.cache is not None:
            self.cache.reset()
            return
        self._held.clear()
        self._pending.append(self.ke.AllBlocksCleared())

    def take_events(self) -> list[Any]:
        if self.cache is not None:
            return self.cache.take_events()
        out, self._pending = self._pending, []
        return out
