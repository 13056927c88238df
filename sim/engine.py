"""The simulated SGLang scheduler: FIFO queue, continuous batching, prefix cache, KvMetrics cadence.

Pure and clock-free: the caller passes `now` (simulated seconds) to every call, so unit tests
drive it with a fake clock and the HTTP server with a scaled wall clock. One scheduler
iteration is two calls: `schedule(now)` picks a batch and says how long it takes;
`complete(batch, now)` applies its results when that time has passed. Like SGLang (without
chunked prefill or mixed batches), a prefill batch is run whenever waiting requests can be
admitted, otherwise one decode step of every running request.

Reports (`on_kv_metrics`) follow the scheduler exactly: after each prefill batch, and every
`decode_log_interval`-th decode step (a lifetime counter), never while idle. Pending KV events
are handed over at those same points and when the engine goes idle. As in SGLang, a prefill
report's `request_active_slots` counts the requests that were already decoding when the batch
was formed (not the new ones), and a decode report counts the whole step's batch, including
requests that finished in it; token usage is measured after the batch.

Memory: a request is admitted only if its whole lifetime fits (prompt pages now, plus pages for
`max_new_tokens` reserved), so decode never runs out of KV and nothing is retracted.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from sim.config import EngineConfig
from sim.kv_events import KvEvent, lora_namespace, page_digest, page_digests
from sim.kv_pool import KvPool
from sim.tokenizer import OutputStream

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request this engine can never serve (too long for the context or the whole KV pool)."""


class ReqState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)
class SimRequest:
    """One request's life: ids in, tokens out, and its timestamps in simulated seconds."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    arrival: float
    state: ReqState = ReqState.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    admit_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # KV bookkeeping
    kv_len: int = 0  # tokens whose KV is stored
    chain: list[bytes] = dataclasses.field(default_factory=list)  # digests of full pages held
    locked: int = 0  # leading pages of `chain` locked in the cache
    private_pages: int = 0
    reserved_pages: int = 0  # pages still to be allocated for future decode tokens
    prefilled: bool = False  # PD decode side: the prompt's KV came from a prefill server (no compute)
    # LoRA (sim.lora): the adapter's id (None: the base model) — its pages live in their own cache
    # namespace (`lora_namespace`), as SGLang's radix cache keys them by lora_id — and its name
    lora_id: str | None = None
    lora_name: str | None = None
    _outputs: OutputStream | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def finished(self) -> bool:
        return self.state in (ReqState.FINISHED, ReqState.ABORTED)


class BatchKind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass
class Batch:
    kind: BatchKind
    reqs: list[SimRequest]
    duration: float  # simulated seconds
    start: float
    new_tokens: int = 0  # prefill: uncached prompt tokens computed
    hit_tokens: int = 0  # prefill: prompt tokens served from the prefix cache
    running_before: int = 0  # requests already decoding when this prefill batch was formed


@dataclasses.dataclass(frozen=True)
class TokenOutput:
    """One generated token (or, with `token_id` None, a finish without a new token)."""

    rid: str
    token_id: int | None
    index: int  # 0-based position in the output
    finished: bool
    finish_reason: str | None = None  # "length" | "abort"


@dataclasses.dataclass(frozen=True)
class KvReport:
    """The eight KvMetrics values, computed as SGLang's scheduler computes them."""

    request_active_slots: int
    request_total_slots: int
    kv_active_blocks: int  # tokens!
    kv_total_blocks: int  # tokens!
    num_requests_waiting: int
    gpu_cache_usage_perc: float
    gpu_prefix_cache_hit_rate: float
    data_parallel_rank: int

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


class EngineListener(Protocol):
    def on_kv_metrics(self, report: KvReport) -> None: ...

    def on_kv_events(self, events: list[KvEvent]) -> None: ...


class NullListener:
    def on_kv_metrics(self, report: KvReport) -> None:
        pass

    def on_kv_events(self, events: list[KvEvent]) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Everything measurable at one instant; cumulative counters since start."""

    num_running_reqs: int
    num_waiting_reqs: int
    waiting_tokens: int
    used_tokens: int
    evictable_tokens: int
    max_total_num_tokens: int
    token_usage: float
    last_prefill_cache_hit_rate: float
    cumulative_cache_hit_rate: float
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    requests_aborted_total: int
    prefill_batches_total: int
    decode_steps_total: int
    prefill_busy_s: float
    decode_busy_s: float
    evicted_pages_total: int
    kv_metrics_reports_total: int
    cached_pages: int
    mean_ttft_s: float  # over requests that got a first token; simulated seconds
    mean_queue_time_s: float  # arrival → admission, same requests


class Engine:
    """SGLang's scheduler, simulated. Not thread-safe: drive it from one task or thread."""

    def __init__(self, config: EngineConfig, listener: EngineListener | None = None) -> None:
        self.config = config
        self.listener: EngineListener = listener or NullListener()
        self.page_size = config.page_size
        self.max_total_num_tokens = config.pool_tokens
        self.pool = KvPool(config.num_pages, config.page_size, record_events=config.record_kv_events)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.reserved_pages = 0
        # PD decode: rid → (prompt pages held, output pages reserved) for a request whose KV is on the way
        self._prealloc: dict[str, tuple[int, int]] = {}
        self.forward_ct_decode = 0
        self._in_flight: Batch | None = None
        # cumulative stats
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._generated = 0
        self._finished = 0
        self._aborted = 0
        self._prefill_batches = 0
        self._decode_steps = 0
        self._prefill_busy = 0.0
        self._decode_busy = 0.0
        self._reports = 0
        self._last_hit_rate = 0.0
        self._ttft_sum = 0.0
        self._queue_sum = 0.0
        self._ttft_count = 0

    # ------------------------------------------------------------------ requests

    def submit(self, rid: str, input_ids: Sequence[int], max_new_tokens: int, now: float, *,
               prefilled: bool = False, lora_id: str | None = None, lora_name: str | None = None) -> SimRequest:
        """Queue a request (FIFO). Raises RequestRejected if it could never run. `prefilled`: its
        prompt's KV was transferred in (PD decode side): admitted like any request, its prompt costs
        no prefill compute (SGLang's decode server runs a "prebuilt" batch for it)."""
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        self.check(input_ids, max_new_tokens)
        req = SimRequest(rid=rid, input_ids=list(input_ids), max_new_tokens=max_new_tokens, arrival=now,
                         prefilled=prefilled, lora_id=lora_id, lora_name=lora_name)
        req._outputs = OutputStream(req.input_ids, self.config.seed)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def prealloc(self, rid: str, prompt_tokens: int, max_new_tokens: int) -> bool:
        """PD decode: hold the prompt's KV pages from the moment the request arrives, as SGLang's
        decode prealloc queue does before the KV is transferred into them (they show in KvMetrics
        and /v1/loads as used), and reserve its output's pages (not shown as used), so that once its
        KV is in it is admitted without waiting for memory, as SGLang's decode runs a transferred
        request at once. False when the pool cannot hold both now: then they are taken at admission
        (SGLang would hold the request in its prealloc queue instead; not modelled). Raises
        RequestRejected for a request id already in use."""
        if rid in self._prealloc or rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        pages = -(-prompt_tokens // self.page_size)
        growth = max(self._final_pages(prompt_tokens, max_new_tokens) - pages, 0)
        if pages + growth > self.pool.available_pages - self.reserved_pages:
            return False
        self.pool.alloc(pages)
        self.reserved_pages += growth
        self._prealloc[rid] = (pages, growth)
        return True

    def release_prealloc(self, rid: str) -> None:
        """Give back a request's preallocated pages (its KV never came, or it is admitted)."""
        pages, growth = self._prealloc.pop(rid, (0, 0))
        self.pool.free(pages)
        self.reserved_pages -= growth

    def check(self, input_ids: Sequence[int], max_new_tokens: int) -> None:
        """Raises RequestRejected if a request could never run here."""
        if not input_ids:
            raise RequestRejected("the prompt is empty: at least one input token is required")
        if max_new_tokens < 0:
            raise RequestRejected(f"max_new_tokens={max_new_tokens} must be >= 0")
        if len(input_ids) >= self.config.context_length:  # SGLang's tokenizer manager, 0.5.23, checks this first
            raise RequestRejected(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.config.context_length} tokens)."
            )
        total = len(input_ids) + max_new_tokens
        if total > self.config.context_length:
            raise RequestRejected(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.config.context_length} tokens. You requested a total of {total} tokens: "
                f"{len(input_ids)} tokens from the input messages and {max_new_tokens} tokens "
                f"for the completion. Please reduce the number of tokens in the input messages "
                f"or the completion to fit within the limit."
            )
        if self._final_pages(len(input_ids), max_new_tokens) > self.pool.num_pages:
            raise RequestRejected(
                f"request needs {total} tokens of KV cache but the pool holds only "
                f"{self.max_total_num_tokens} (max_total_num_tokens); shorten the prompt or "
                f"max_tokens"
            )

    def abort(self, rid: str, now: float) -> bool:
        """Drop a request (client went away). Its KV is released now or after the batch in flight."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        if req.state == ReqState.WAITING:
            self.release_prealloc(rid)
            self.waiting.remove(req)
            req.state = ReqState.ABORTED
            req.finish_time = now
            self._aborted += 1
            del self.requests[rid]
            return True
        req.state = ReqState.ABORTED
        if self._in_flight is None or req not in self._in_flight.reqs:
            self._release(req, now, insert_output=False)
            self.running.remove(req)
            self._aborted += 1
            del self.requests[rid]
        return True

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self._in_flight is None

    # ------------------------------------------------------------------ scheduling

    def schedule(self, now: float) -> Batch | None:
        """Pick the next batch: admit waiting requests (prefill) if any fit, else decode."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called before complete() of the batch in flight")
        batch = self._form_prefill(now) or self._form_decode(now)
        self._in_flight = batch
        return batch

    def _final_pages(self, input_len: int, max_new_tokens: int) -> int:
        # the last generated token's KV is never computed
        final_kv = input_len + max(max_new_tokens - 1, 0)
        return -(-final_kv // self.page_size)

    def _form_prefill(self, now: float) -> Batch | None:
        admitted: list[SimRequest] = []
        new_tokens = hit_tokens = 0
        ps = self.page_size
        skipped = False
        loras = {r.lora_id for r in self.running} if self.config.max_loras_per_batch is not None else None
        for req in self.waiting:
            if len(self.running) + len(admitted) >= self.config.max_running_requests:
                break
            if loras is not None and req.lora_id not in loras and len(loras) >= self.config.max_loras_per_batch:
                skipped = True  # SGLang: `can_schedule_lora_req` false → `continue`, later ones may go
                continue
            n_in = len(req.input_ids)
            # SGLang matches at most len-1 tokens: the last prompt token is always computed
            matchable = (n_in - 1) // ps
            if len(req.chain) < n_in // ps:
                req.chain = page_digests(req.input_ids, ps, lora_namespace(req.lora_id))
            matched = self.pool.match(req.chain[:matchable])
            cached = matched * ps
            uncached = 0 if req.prefilled else n_in - cached
            if admitted and new_tokens + uncached > self.config.max_prefill_tokens:
                break
            private_now = -(-n_in // ps) - matched
            growth = self._final_pages(n_in, req.max_new_tokens) - matched - private_now
            capacity = (
                self.pool.available_pages
                - self.pool.unlocked_count(req.chain[:matched])
                - self.reserved_pages
                + sum(self._prealloc.get(req.rid, (0, 0)))  # what it preallocated (PD decode) is its own
            )
            if private_now + max(growth, 0) > capacity:
                if req.prefilled and self._prealloc:
                    # PD decode: requests behind it whose KV is in hold their memory already (SGLang
                    # runs them at once); waiting for them would wait for ever
                    skipped = True
                    continue
                break  # FIFO: the head waits for memory, nobody overtakes it
            self.release_prealloc(req.rid)  # they become its private pages just below
            self.pool.lock(req.chain[:matched], now)
            self.pool.alloc(private_now)
            req.locked = matched
            req.private_pages = private_now
            req.reserved_pages = max(growth, 0)
            self.reserved_pages += req.reserved_pages
            req.cached_tokens = cached
            req.admit_time = now
            req.state = ReqState.RUNNING
            admitted.append(req)
            if loras is not None:
                loras.add(req.lora_id)
            new_tokens += uncached
            hit_tokens += cached
        if not admitted:
            return None
        if skipped:
            taken = set(map(id, admitted))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        else:
            for _ in admitted:
                self.waiting.popleft()
        duration = self.config.prefill_base_s + self.config.prefill_per_token_s * new_tokens
        return Batch(
            kind=BatchKind.PREFILL,
            reqs=admitted,
            duration=duration,
            start=now,
            new_tokens=new_tokens,
            hit_tokens=hit_tokens,
            running_before=len(self.running),
        )

    def _form_decode(self, now: float) -> Batch | None:
        if not self.running:
            return None
        reqs = list(self.running)
        kv_tokens = sum(r.kv_len for r in reqs)
        c = self.config
        duration = c.decode_base_s + c.decode_per_req_s * len(reqs) + c.decode_per_kv_token_s * kv_tokens
        return Batch(kind=BatchKind.DECODE, reqs=reqs, duration=duration, start=now)

    # ------------------------------------------------------------------ results

    def complete(self, batch: Batch, now: float) -> list[TokenOutput]:
        """Apply a batch's results at `now` (its end). Returns the tokens it produced."""
        if batch is not self._in_flight:
            raise RuntimeError("complete() of a batch that is not the one in flight")
        self._in_flight = None
        if batch.kind == BatchKind.PREFILL:
            outputs = self._complete_prefill(batch, now)
        else:
            outputs = self._complete_decode(batch, now)
        if self.is_idle:
            self._publish_events()  # SGLang flushes pending KV events when it goes idle
        return outputs

    def _complete_prefill(self, batch: Batch, now: float) -> list[TokenOutput]:
        self._prefill_batches += 1
        self._prefill_busy += batch.duration
        outputs: list[TokenOutput] = []
        for req in batch.reqs:
            self._prompt_tokens += len(req.input_ids)
            self._cached_tokens += req.cached_tokens
            if req.state == ReqState.ABORTED:
                outputs.append(self._drop_aborted(req, now))
                continue
            req.kv_len = len(req.input_ids)
            # SGLang inserts the prefilled prompt into the radix cache (cache_unfinished_req)
            self._cache_chain(req, len(req.chain), now)
            req.first_token_time = now
            self._ttft_sum += now - req.arrival
            self._queue_sum += (req.admit_time or req.arrival) - req.arrival
            self._ttft_count += 1
            if req.max_new_tokens == 0:
                outputs.append(self._finish(req, now, token=None))
                continue
            token = self._next_token(req)
            if len(req.output_ids) >= req.max_new_tokens:
                outputs.append(self._finish(req, now, token=token))
            else:
                outputs.append(TokenOutput(req.rid, token, 0, False))
                self.running.append(req)
        total = batch.new_tokens + batch.hit_tokens
        self._last_hit_rate = batch.hit_tokens / total if total else 0.0
        usage = self.pool.used_tokens / self.max_total_num_tokens
        if self.config.round_prefill_usage or self.config.round_usage:
            usage = round(usage, 2)
        self._report(
            active=batch.running_before, usage=usage, hit_rate=self._last_hit_rate
        )
        self._publish_events()
        return outputs

    def _complete_decode(self, batch: Batch, now: float) -> list[TokenOutput]:
        self._decode_steps += 1
        self._decode_busy += batch.duration
        self.forward_ct_decode += 1
        outputs: list[TokenOutput] = []
        for req in batch.reqs:
            if req.state == ReqState.ABORTED:
                self.running.remove(req)
                outputs.append(self._drop_aborted(req, now))
                continue
            # this step computed the KV of the previous token and sampled the next one
            req.kv_len += 1
            if req.kv_len > (req.locked + req.private_pages) * self.page_size:
                self.pool.alloc(1)
                req.private_pages += 1
                req.reserved_pages -= 1
                self.reserved_pages -= 1
            token = self._next_token(req)
            if len(req.output_ids) >= req.max_new_tokens:
                self.running.remove(req)
                outputs.append(self._finish(req, now, token=token))
            else:
                outputs.append(TokenOutput(req.rid, token, len(req.output_ids) - 1, False))
        if self.forward_ct_decode % self.config.decode_log_interval == 0:
            usage = self.pool.used_tokens / self.max_total_num_tokens
            if self.config.round_usage:
                usage = round(usage, 2)
            hit_rate = self._last_hit_rate if self.config.decode_keeps_hit_rate else 0.0
            self._report(active=len(batch.reqs), usage=usage, hit_rate=hit_rate)
            self._publish_events()
        return outputs

    def _next_token(self, req: SimRequest) -> int:
        assert req._outputs is not None
        token = req._outputs.next_token()
        req.output_ids.append(token)
        self._generated += 1
        return token

    def _finish(self, req: SimRequest, now: float, token: int | None) -> TokenOutput:
        req.state = ReqState.FINISHED
        req.finish_time = now
        self._release(req, now, insert_output=True)
        self._finished += 1
        del self.requests[req.rid]
        index = len(req.output_ids) - 1 if token is not None else -1
        return TokenOutput(req.rid, token, index, True, "length")

    def _drop_aborted(self, req: SimRequest, now: float) -> TokenOutput:
        req.finish_time = now
        self._release(req, now, insert_output=False)
        self._aborted += 1
        self.requests.pop(req.rid, None)
        return TokenOutput(req.rid, None, -1, True, "abort")

    # ------------------------------------------------------------------ KV bookkeeping

    def _cache_chain(self, req: SimRequest, upto_pages: int, now: float) -> None:
        """Move the request's full pages `locked … upto_pages` from private into the cache."""
        if upto_pages <= req.locked:
            return
        tokens = req.input_ids + req.output_ids
        moved, deduped = self.pool.insert(req.chain[:upto_pages], tokens, req.locked, now, lora_name=req.lora_name)
        req.private_pages -= moved + deduped
        req.locked = upto_pages

    def _release(self, req: SimRequest, now: float, *, insert_output: bool) -> None:
        """Return a request's KV: full pages stay cached (unlocked), the rest is freed."""
        if req.admit_time is None:
            return
        if insert_output and req.kv_len:
            # cache_finished_req: prompt + output whose KV exists, page aligned
            seq = (req.input_ids + req.output_ids)[: req.kv_len]
            full = req.kv_len // self.page_size
            while len(req.chain) < full:
                i = len(req.chain)
                parent = req.chain[-1] if req.chain else lora_namespace(req.lora_id)
                req.chain.append(page_digest(parent, seq[i * self.page_size : (i + 1) * self.page_size]))
            self._cache_chain(req, full, now)
        self.pool.unlock(req.chain[: req.locked], now)
        self.pool.free(req.private_pages)
        self.reserved_pages -= req.reserved_pages
        req.locked = req.private_pages = req.reserved_pages = 0

    # ------------------------------------------------------------------ reports

    def _report(self, *, active: int, usage: float, hit_rate: float) -> None:
        self._reports += 1
        self.listener.on_kv_metrics(
            KvReport(
                request_active_slots=active,
                request_total_slots=self.config.max_running_requests,
                kv_active_blocks=int(usage * self.max_total_num_tokens),
                kv_total_blocks=self.max_total_num_tokens,
                num_requests_waiting=len(self.waiting),
                gpu_cache_usage_perc=float(usage),
                gpu_prefix_cache_hit_rate=float(hit_rate),
                data_parallel_rank=self.config.dp_rank,
            )
        )

    def _publish_events(self) -> None:
        events = self.pool.take_events()
        if events:
            self.listener.on_kv_events(events)

    # ------------------------------------------------------------------ admin / stats

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: only when nothing runs or waits. Emits AllBlocksCleared."""
        if not self.is_idle:
            return False
        ok = self.pool.clear()
        self._publish_events()
        return ok

    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            waiting_tokens=sum(len(r.input_ids) for r in self.waiting),
            used_tokens=pool.used_tokens,
            evictable_tokens=pool.evictable_tokens,
            max_total_num_tokens=self.max_total_num_tokens,
            token_usage=pool.used_tokens / self.max_total_num_tokens,
            last_prefill_cache_hit_rate=self._last_hit_rate,
            cumulative_cache_hit_rate=(
                self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
            ),
            prompt_tokens_total=self._prompt_tokens,
            cached_tokens_total=self._cached_tokens,
            generation_tokens_total=self._generated,
            requests_finished_total=self._finished,
            requests_aborted_total=self._aborted,
            prefill_batches_total=self._prefill_batches,
            decode_steps_total=self._decode_steps,
            prefill_busy_s=self._prefill_busy,
            decode_busy_s=self._decode_busy,
            evicted_pages_total=pool.evicted_pages_total,
            kv_metrics_reports_total=self._reports,
            cached_pages=len(pool.cached),
            mean_ttft_s=self._ttft_sum / self._ttft_count if self._ttft_count else 0.0,
            mean_queue_time_s=self._queue_sum / self._ttft_count if self._ttft_count else 0.0,
        )


def run_until_idle(
    engine: Engine, clock: Callable[[], float], advance: Callable[[float], None], max_steps: int = 1_000_000
) -> list[TokenOutput]:
    """Drive an engine on a fake clock until nothing runs or waits (tests and tools)."""
    outputs: list[TokenOutput] = []
    for _ in range(max_steps):
        batch = engine.schedule(clock())
        if batch is None:
            return outputs
        advance(batch.duration)
        outputs.extend(engine.complete(batch, clock()))
    raise RuntimeError(f"engine not idle after {max_steps} steps")
