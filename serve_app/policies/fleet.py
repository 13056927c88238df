"""FleetView: the worker views in fleet order, updated one worker at a time, with cached per-policy columns.

Policies accept any `Sequence[WorkerView]`; a `FleetView` is one that also lets a policy keep
derived per-worker numbers (e.g. kv_aware's request-independent cost terms, as named numpy
columns) across requests, refreshed only for the workers that changed. The router keeps one
FleetView, rebuilds it when a snapshot arrives and `update`s the few workers whose ledger figures
changed per request (`serve_app.ledger.refresh_fleet`), so a decision costs O(1) Python work per
changed worker plus a handful of vectorised operations over the fleet.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Iterator, Protocol, Sequence, TypeVar, overload

import numpy as np

from serve_app.policies.base import WorkerView
from serve_app.policies.overlap import worker_id, worker_id_count

class Derived(Protocol):
    """Per-worker numbers a policy derives from the views and keeps across requests."""

    def set(self, i: int, view: WorkerView) -> None:
        """Worker `i`'s view changed to `view`: refresh its numbers (and any fleet-wide figure)."""


D = TypeVar("D", bound=Derived)


class _Positions(dict):
    """name → position; a missing name maps to -1 (so C-level `map` lookups never raise)."""

    __slots__ = ()

    def __missing__(self, key: str) -> int:
        return -1


class FleetView(Sequence[WorkerView]):
    """Worker views in a stable order; `update` replaces one worker's view in O(derived columns)."""

    __slots__ = ("_views", "_pos", "_derived", "_names", "_pos_by_id")

    def __init__(self, views: Iterable[WorkerView] = ()) -> None:
        self._views: list[WorkerView] = []
        self._pos: _Positions = _Positions()
        self._derived: dict[Hashable, Derived] = {}
        self._names: list[str] | None = None
        self._pos_by_id: np.ndarray | None = None
        for v in views:
            if v.name in self._pos:
                raise ValueError(f"worker {v.name!r} appears twice in the fleet view")
            self._pos[v.name] = len(self._views)
            self._views.append(v)

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> WorkerView: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerView]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._views[i]

    def __iter__(self) -> Iterator[WorkerView]:
        return iter(self._views)

    @property
    def names(self) -> list[str]:
        """Worker names in fleet order (cached; do not mutate)."""
        n = self._names
        if n is None:
            n = self._names = [v.name for v in self._views]
        return n

    def position(self, name: str) -> int | None:
        return self._pos.get(name)

    @property
    def position_or_minus_one(self) -> Callable[[str], int]:
        """A C-level lookup name → position (-1 when absent), for `map` over many names."""
        return self._pos.__getitem__

    def positions_by_id(self) -> np.ndarray:
        """`worker_id` → position in this fleet, for every interned name; names outside the fleet
        map to `len(self)` (a spare slot, so a scatter into a vector of len + 1 needs no mask)."""
        a = self._pos_by_id
        if a is None or len(a) < worker_id_count():
            n = len(self._views)
            ids = np.fromiter((worker_id(v.name) for v in self._views), np.intp, n)
            a = np.full(worker_id_count(), n, np.intp)
            a[ids] = np.arange(n)
            self._pos_by_id = a
        return a

    def get(self, name: str) -> WorkerView | None:
        i = self._pos.get(name)
        return None if i is None else self._views[i]

    def update(self, view: WorkerView) -> None:
        """Replace (or append) the view of `view.name`; cached columns follow."""
        i = self._pos.get(view.name)
        if i is None:
            self._pos[view.name] = len(self._views)
            self._views.append(view)
            self._membership_changed()
            return
        self._views[i] = view
        for d in self._derived.values():
            d.set(i, view)

    def remove(self, name: str) -> None:
        i = self._pos.pop(name, None)
        if i is None:
            return
        del self._views[i]
        self._pos = _Positions((v.name, k) for k, v in enumerate(self._views))
        self._membership_changed()

    def _membership_changed(self) -> None:
        self._derived.clear()
        self._names = None
        self._pos_by_id = None

    def derived(self, key: Hashable, build: Callable[[list[WorkerView]], D]) -> D:
        """`build(views)` for the current workers, cached under `key`; `update` calls its `set` for
        each changed worker, and a change of membership drops it (rebuilt on the next call)."""
        d = self._derived.get(key)
        if d is None:
            d = self._derived[key] = build(self._views)
        return d  # type: ignore[return-value]
