"""What every routing policy sees and returns: the request, the fleet view, the decision."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, NamedTuple, Protocol, Sequence

_NO_OVERLAP: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it at decision time (snapshot + its own ledger).

    Reported figures (`running`, `waiting`, `kv_active_blocks`) are zeroed for `idle` workers —
    their last report is not load — while capacities (`total_slots`, `kv_total_blocks`) are kept.
    `kv_*_blocks` are in blocks of the worker's `page_size` (tokens / page_size, as reported).

    The ledger fields say what the router knows that the last report cannot show yet
    (see `serve_app.ledger.Ledger.apply`); their block counts are in blocks of the router's
    `block_tokens` (`RouteRequest.block_tokens`), like `RouteRequest.overlap`.
    """

    name: str
    url: str
    state: str  # "live" | "idle" | "down"
    page_size: int = 1
    running: int = 0  # reported request_active_slots
    total_slots: int = 0  # reported request_total_slots (0 = unknown)
    waiting: int = 0  # reported num_requests_waiting
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0  # 0 = unknown
    in_flight: int = 0  # dispatched by this router replica and not yet finished (all of them)
    # ledger: dispatched by this replica and not visible in the last report (idle: all in-flight)
    pending: int = 0
    pending_prefill_blocks: int = 0  # prompt blocks still to prefill: every request of this
    # replica before its first token, absorbed by a report or not (a report never shows that work)
    pending_kv_blocks: int = 0  # KV blocks those requests hold or will hold
    remote_pending: int = 0  # the same count from other router replicas (sizes unknown)
    # prefix index: blocks this router reused on the worker lately, or first sent there just now
    # (`PrefixIndex.hot_blocks`) — valuable in its cache, what a new prompt there would evict
    hot_blocks: int = 0
    # ledger: requests this replica saw finish there within LedgerConfig.followup_window_s
    recent_finished: int = 0
    # prefix index: the part of hot_blocks reused lately, not just sent once (`reused_blocks`)
    reused_blocks: int = 0
    # ledger: when this replica last routed a request there (ledger clock; 0 = never)
    last_routed_at: float = 0.0
    # ledger: this replica's requests there not yet past their first token (they share the next
    # prefill batches with whatever is sent there now)
    prefilling: int = 0
    # a DP-attention rank of a worker with dp_size > 1 is a routing target of its own: `name` is then
    # `target_name(worker, rank)`, `worker` the worker's name and `rank` its attention-DP rank; a
    # worker without DP ranks is one target (`worker` "" = `name`, `rank` None: nothing to pin)
    worker: str = ""
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The routing-relevant facts of one request, extracted once from its body.

    `block_hashes[i]` is a chained hash of prompt block i (`block_tokens` tokens): equal hashes
    mean equal prompt prefixes up to and including that block. `overlap` maps a worker name to the
    number of leading blocks of this prompt it is believed to hold in its prefix cache; the router
    fills it per request from the prefix index (`with_overlap`); workers absent from it hold none.
    """

    prompt: str = ""  # the whole prompt as the engine sees it (all chat messages, in order)
    prompt_tokens: int = 0  # estimate (or exact, when token ids were given)
    max_tokens: int = 0  # 0 = not given
    block_hashes: tuple[int, ...] = ()  # chained hashes of page-sized prompt blocks
    block_tokens: int = 16  # tokens per block of `block_hashes`, `overlap` and ledger figures
    token_ids: tuple[int, ...] = ()  # when the body carried token ids (or the router tokenized)
    overlap: Mapping[str, int] = field(default_factory=lambda: _NO_OVERLAP, compare=False)

    @property
    def prompt_blocks(self) -> int:
        """Blocks the whole prompt occupies (ceil), the unit of every kv_aware term."""
        return -(-self.prompt_tokens // self.block_tokens)

    def with_overlap(self, overlap: Mapping[str, int]) -> "RouteRequest":
        """The same request with per-worker prefix overlap (blocks) filled in."""
        return replace(self, overlap=overlap)


class Decision(NamedTuple):
    """The chosen worker (a NamedTuple: built once per request, in C). `why` is the reason as text,
    or as (format, *args) formatted only when `reason` is read (/route, debug logs): formatting
    floats costs more than a small decision. `rank` is the attention-DP rank to pin (None: the
    worker has no DP ranks) and `target` the chosen view's name (`target_name`; "" = `worker`)."""

    worker: str
    url: str
    policy: str
    why: str | tuple = ""
    rank: int | None = None
    target: str = ""

    @property
    def reason(self) -> str:
        why = self.why
        return why if isinstance(why, str) else why[0].format(*why[1:])


RANK_SEPARATOR = "@"  # never in a worker name (actors.fleet), so a target name cannot clash with one


def target_name(worker: str, rank: int | None) -> str:
    """The routing target of `worker`'s attention-DP `rank` (None: the worker itself)."""
    return worker if rank is None else f"{worker}{RANK_SEPARATOR}{rank}"


def decision(w: WorkerView, policy: str, why: str | tuple = "") -> Decision:
    """The decision for view `w`: its worker, URL and (a DP worker's) rank."""
    if w.rank is None:
        return Decision(w.name, w.url, policy, why)
    return Decision(w.worker, w.url, policy, why, w.rank, w.name)


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request (all down, or none registered)."""


class Policy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> Decision: ...


def routable(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers a policy may pick: never `down`. Raises NoWorkerAvailable when none is left."""
    out = [w for w in workers if w.state != "down"]
    if not out:
        _raise_none(workers)
    return out


def _raise_none(workers: Sequence[WorkerView]) -> None:
    states = ", ".join(f"{w.name}={w.state}" for w in workers) or "no workers registered"
    raise NoWorkerAvailable(f"no routable worker ({states})")


@dataclass(slots=True)
class _Argmin:
    """Keeps the cheapest candidates; ties broken uniformly at random by the caller's rng."""

    best: float = float("inf")
    items: list[WorkerView] = field(default_factory=list)

    def add(self, cost: float, w: WorkerView, eps: float = 1e-9) -> None:
        if cost < self.best - eps:
            self.best, self.items = cost, [w]
        elif cost <= self.best + eps:
            self.items.append(w)
