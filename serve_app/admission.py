"""Late binding for big prompts: when every worker is already prefilling, hold a big prompt in the
router until one of them reaches a first token, then route it.

A router that commits each request to a worker the moment it arrives queues a big prompt behind
whatever the chosen worker prefills next — and the router cannot see how far along that is. When
every worker already has a streamed request of this replica before its first token, committing a
big prompt now only picks a queue; holding it until the first of those first tokens arrives (the
router relays the streams, so it sees them at once) routes it to the worker that has just freed up,
with a view that is newer. One shared FIFO queue instead of a queue per worker: the classic
central-queue effect, for exactly the requests whose queueing decides the TTFT tail.

Only kv_aware's requests are held (round_robin and the others stay what their names say), and only
big prompts (`min_uncached_blocks` the chosen worker would still have to prefill): a
prompt mostly cached where it goes costs little to add to that worker's next batch, and holding it
would make a conversation's next turn wait for nothing. Only streamed requests count as prefilling
(a non-streamed reply's first token is not seen before its end), and only this replica's own. A
request is held at most `max_wait_s`; beyond `max_held` waiting, new ones are not held. Measured on
the Mooncake trace in routesim and through the real path in bench/results/standard-mooncake-4.md.

Pure asyncio, no Ray: `RouterCore` owns one `Admission`; `RequestTicket` reports each streamed
request's dispatch, first token and end; `serve_app.forward` awaits `hold()`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """When a big prompt waits in the router for a worker to free up (`router.admission`)."""

    enabled: bool = True
    """Hold big streamed prompts routed by kv_aware while every worker is prefilling one of this
    replica's streams (the other policies route as they are named)."""
    max_prefilling: int = 1
    """A worker counts as busy from this many streamed requests of this replica before their first token."""
    min_uncached_blocks: int = 64
    """A prompt is held only if the worker the policy picks would still prefill at least this many of
    its blocks (router blocks of `router.block_size` tokens; 64 × 16 = 1,024 tokens)."""
    max_wait_s: float = 5.0
    """A held request is routed after this long even if no worker freed up."""
    max_held: int = 1024
    """At most this many requests wait at once; further ones are routed at once."""

    def __post_init__(self) -> None:
        if self.max_prefilling < 1:
            raise ValueError(f"max_prefilling must be ≥ 1, got {self.max_prefilling}")
        if self.min_uncached_blocks < 0:
            raise ValueError(f"min_uncached_blocks must be ≥ 0, got {self.min_uncached_blocks}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")
        if self.max_held < 0:
            raise ValueError(f"max_held must be ≥ 0, got {self.max_held}")


class Admission:
    """The per-target count of streamed requests before their first token, and the FIFO queue of
    held requests. One per router replica (one asyncio loop; not thread-safe)."""

    def __init__(self, config: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or AdmissionConfig()
        self._clock = clock
        self.prefilling: dict[str, int] = {}  # target → streamed requests before their first token
        self._busy = 0  # targets at max_prefilling or above
        self._waiters: deque[Callable[[], bool]] = deque()  # each wakes one held request
        self.held = 0  # requests held so far (a counter for /metrics)
        self.timed_out = 0  # of those, released by max_wait_s

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def saturated(self, targets: Iterable[tuple[str, bool]]) -> bool:
        """Whether every routable target of `targets` ((name, routable) pairs) is busy — or others
        already wait (first come, first served). Cheap when nothing is busy."""
        if not self.config.enabled or len(self._waiters) >= self.config.max_held:
            return False
        if self._waiters:
            return True
        if self._busy == 0:
            return False
        return self.all_busy(targets)

    def all_busy(self, targets: Iterable[tuple[str, bool]]) -> bool:
        """Whether every routable target of `targets` ((name, routable) pairs) has `max_prefilling`
        streamed requests before their first token (False when none is routable)."""
        cap, counts = self.config.max_prefilling, self.prefilling
        seen = False
        for name, routable in targets:
            if routable:
                if counts.get(name, 0) < cap:
                    return False
                seen = True
        return seen

    def big(self, uncached_blocks: int) -> bool:
        return uncached_blocks >= self.config.min_uncached_blocks

    def enqueue(self, wake: Callable[[], bool]) -> Callable[[], None]:
        """Join the queue: `wake()` is called when it is this waiter's turn (it returns False if the
        waiter is gone, and the next one is woken instead). Returns what takes it out of the queue
        (call it when it stops waiting for another reason). `hold` is this for one asyncio task;
        routesim queues its simulated requests the same way."""
        self._waiters.append(wake)
        self.held += 1

        def leave() -> None:
            try:
                self._waiters.remove(wake)
            except ValueError:
                pass
        return leave

    async def hold(self) -> float:
        """Wait until a worker frees up (a first token, or a request that ended before one) or
        `max_wait_s` passes; FIFO. Returns the seconds held."""
        t0 = self._clock()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> bool:
            if fut.done():
                return False
            fut.set_result(None)
            return True

        leave = self.enqueue(wake)
        try:
            await asyncio.wait_for(fut, self.config.max_wait_s)
        except asyncio.TimeoutError:
            self.timed_out += 1
        finally:
            leave()
        return self._clock() - t0

    # -- the moments of a streamed request (RequestTicket) -------------------------------------

    def dispatched(self, target: str) -> None:
        n = self.prefilling.get(target, 0) + 1
        self.prefilling[target] = n
        if n == self.config.max_prefilling:
            self._busy += 1

    def prefilled(self, target: str) -> None:
        """Its first token arrived, or it ended (failed, cancelled) before one."""
        n = self.prefilling.get(target, 0)
        if n <= 0:
            return
        if n == 1:
            del self.prefilling[target]
        else:
            self.prefilling[target] = n - 1
        if n == self.config.max_prefilling:  # busy → free: the first waiter may go
            self._busy -= 1
            self.release(1)

    def forget(self, target: str) -> None:
        """`target` left the fleet: its requests end with it (their tickets may still report)."""
        if self.prefilling.pop(target, 0) >= self.config.max_prefilling:
            self._busy -= 1

    def release(self, n: int) -> None:
        """Let the first `n` waiters go (each routes among whatever is free by then): a target
        freed up, or new ones joined the fleet."""
        while n > 0 and self._waiters:
            if self._waiters.popleft()():
                n -= 1
