"""The sim's data-parallel front, as SGLang's: which attention-DP rank serves a request.

Facts (released sources): from 0.5.14 a request pins a rank with `routed_dp_rank` in the body of
/generate, /v1/completions and /v1/chat/completions, `data_parallel_rank` being a deprecated alias
read only when `routed_dp_rank` is absent; the OpenAI routes also read the header
`X-Data-Parallel-Rank` (it wins over the body; a non-integer is a 400), and 0.5.23 the header
`x-override-routed-dp-rank` on /generate and chat. The tokenizer manager refuses a rank outside
[0, dp_size) with `routed_dp_rank=R out of range [0, N)` (400), except rank 0 on a server without DP
(ignored). 0.4.9 reads `data_parallel_rank` on /generate only (the OpenAI routes drop it); it has
no range check — its DP controller indexes its worker list and fails — so the sim refuses an
out-of-range rank with the same message instead. Releases between 0.4.9 and 0.5.14 are modelled as
0.4.9 (not checked). An unpinned request goes where `DataParallelController` sends it by default:
`--load-balance-method` round_robin (0.4.9's default; `auto` resolves to it outside PD from 0.5.14).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from sim.protocol import BadRequest

Route = Literal["chat", "completion", "generate"]


def _release(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("-")[0].split("."))


def requested_rank(release: str, route: Route, body: Any, headers: Mapping[str, str]) -> int | None:
    """The rank a request pins as SGLang `release` reads it (None: not pinned). Raises BadRequest
    for a rank header that is not an integer."""
    rel = _release(release)
    if rel < (0, 5, 14):
        return getattr(body, "data_parallel_rank", None) if route == "generate" else None
    rank = getattr(body, "routed_dp_rank", None)
    if rank is None:
        rank = getattr(body, "data_parallel_rank", None)
    if route in ("chat", "completion"):
        value = headers.get("x-data-parallel-rank")
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                raise BadRequest(f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{value}'") from None
    if rel >= (0, 5, 23) and route in ("chat", "generate"):
        value = headers.get("x-override-routed-dp-rank")
        if value is not None:
            try:
                rank = int(value)
            except ValueError as exc:
                raise BadRequest(f"invalid x-override-routed-dp-rank header {value!r}: {exc}") from None
    return rank


class DpController:
    """Picks the rank of each request: the pinned one (range-checked as SGLang does), else the next
    in round-robin order (SGLang's default load-balance method)."""

    def __init__(self, dp_size: int, release: str) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.release = release
        self._next = 0
        self._next_health = 0  # health checks take turns on a counter of their own, as in SGLang

    def choose(self, pinned: int | None, *, health: bool = False, room: int | None = None,
               follow_room: bool = False) -> int:
        """The rank to serve on; raises BadRequest for a pinned rank outside [0, dp_size). With
        `follow_room` (SGLang's follow_bootstrap_room, a PD prefill server's default) an unpinned
        request with bootstrap `room` goes to rank `room % dp_size`."""
        n = self.dp_size
        if pinned is not None and not (n <= 1 and pinned == 0):
            if pinned < 0 or pinned >= n:
                field = "routed_dp_rank" if _release(self.release) >= (0, 5, 14) else "data_parallel_rank"
                raise BadRequest(f"{field}={pinned} out of range [0, {n})")
            return pinned
        if follow_room and room is not None:
            return room % n
        if health:
            rank = self._next_health
            self._next_health = (rank + 1) % n
            return rank
        rank = self._next
        self._next = (rank + 1) % n
        return rank
