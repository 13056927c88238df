"""The prefix overlap of one prompt — per worker, the leading blocks it holds — kept as a few tiers of holders.

A shared system prompt is held by most of a large fleet, so a `{worker: blocks}` dict per request
costs O(workers) Python work on every decision. The prefix indexes answer with *tiers* instead:
`(blocks, holders)` where `holders` is the index's own holder set of the prompt's block
`blocks − 1` (nested: a deeper tier's holders are a subset of a shallower one's), so a worker's
overlap is the `blocks` of the deepest tier holding it. Policies that score the whole fleet read
the tiers as integer id arrays (`Holders.ids`, cached while a holder set's membership is unchanged)
and scatter them into a vector in a handful of numpy operations; everything else reads `Overlap`
as the `Mapping[str, int]` it is.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

_WORKER_IDS: dict[str, int] = {}


def worker_id(name: str) -> int:
    """A small integer for a worker name, the same for the life of the process (interned once:
    the prefix indexes and the fleet view exchange worker sets as arrays of these)."""
    i = _WORKER_IDS.get(name)
    if i is None:
        i = _WORKER_IDS[name] = len(_WORKER_IDS)
    return i


def worker_id_count() -> int:
    """How many worker names have an id (the bound of every id array)."""
    return len(_WORKER_IDS)


class Holders(dict):
    """A holder set of one block: worker → the owning index's value (last use, or a count).

    Whoever adds or removes a key calls `membership_changed()`; `ids()` is then rebuilt once."""

    __slots__ = ("_ids",)

    def ids(self) -> np.ndarray:
        """The holders' `worker_id`s (cached until the membership changes)."""
        try:
            ids = self._ids
        except AttributeError:
            ids = None
        if ids is None:
            ids = self._ids = np.fromiter(map(worker_id, self), np.intp, len(self))
        return ids

    def membership_changed(self) -> None:
        self._ids = None


_NOTHING: Mapping[str, int] = {}


class Overlap(Mapping[str, int]):
    """Per worker, the leading blocks of one prompt it holds; workers with none are absent.

    `tiers`: `(blocks, holders)` from the shallowest to the deepest; every worker in `holders` holds
    at least `blocks` blocks and a deeper tier overrides a shallower one. `fixed`: per-worker values
    that override every tier (an exact index's answer, a holder found stale; 0 = none)."""

    __slots__ = ("tiers", "fixed", "_dict")

    def __init__(self, tiers: list[tuple[int, Mapping[str, object]]] = (),  # type: ignore[assignment]
                 fixed: Mapping[str, int] = _NOTHING) -> None:
        self.tiers = list(tiers)
        self.fixed = fixed
        self._dict: dict[str, int] | None = None

    def get(self, name: str, default: int | None = None) -> int | None:  # type: ignore[override]
        v = self.fixed.get(name)
        if v is not None:
            return v if v > 0 else default
        for blocks, holders in reversed(self.tiers):
            if name in holders:
                return blocks
        return default

    def __getitem__(self, name: str) -> int:
        v = self.get(name)
        if v is None:
            raise KeyError(name)
        return v

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def as_dict(self) -> dict[str, int]:
        """The overlap as a plain dict (O(holders); for logs and tests, not the decision path)."""
        d = self._dict
        if d is None:
            d = {}
            for blocks, holders in self.tiers:
                d.update(dict.fromkeys(holders, blocks))
            for name, v in self.fixed.items():
                if v > 0:
                    d[name] = v
                else:
                    d.pop(name, None)
            self._dict = d
        return d

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def __bool__(self) -> bool:
        return bool(self.tiers) if not self.fixed else bool(self.as_dict())

    def override(self, values: Mapping[str, int]) -> "Overlap":
        """This overlap with `values` replacing the named workers' (0 = none)."""
        return Overlap(self.tiers, {**self.fixed, **values})

    def __repr__(self) -> str:
        return f"Overlap({self.as_dict()!r})"
