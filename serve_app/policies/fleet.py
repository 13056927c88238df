"""FleetView: the worker views in fleet order, updated one worker at a time, with cached per-policy columns.

Policies accept any `Sequence[WorkerView]`; a `FleetView` is one that also lets a policy keep
derived per-worker numbers (e.g. kv_aware's request-independent cost terms) across requests, as
Python lists and numpy arrays, refreshed only for the rows that changed. The router keeps one
FleetView, rebuilds it when a snapshot arrives and `update`s the few workers whose ledger figures
changed per request (`serve_app.ledger.refresh_fleet`), so a decision costs O(1) Python work per
changed worker plus a handful of vectorised operations over the fleet.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Iterator, Sequence, overload

import numpy as np

from serve_app.policies.base import WorkerView

RowFn = Callable[[WorkerView], tuple[float, ...]]
SetHook = Callable[["Columns", tuple[float, ...], tuple[float, ...]], None]


class Columns:
    """Derived per-worker numbers: `rows[i]` (tuples) and `arrays[k][i]` (float64 columns).

    `extra` is free for the owner to cache fleet-wide figures. When a row changes, `on_set(cols,
    old_row, new_row)` keeps them current if the owner gave one; otherwise `extra` is cleared."""

    __slots__ = ("rows", "_arrays", "extra", "on_set")

    def __init__(self, rows: list[tuple[float, ...]], on_set: SetHook | None = None) -> None:
        self.rows = rows
        self._arrays: tuple[np.ndarray, ...] | None = None
        self.extra: dict[str, object] = {}
        self.on_set = on_set

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            a = np.array(self.rows, dtype=np.float64).reshape(len(self.rows), -1)
            self._arrays = tuple(np.ascontiguousarray(a[:, k]) for k in range(a.shape[1]))
        return self._arrays

    def _set(self, i: int, row: tuple[float, ...]) -> None:
        old = self.rows[i]
        self.rows[i] = row
        if self._arrays is not None:
            for col, v in zip(self._arrays, row):
                col[i] = v
        if self.on_set is None:
            self.extra.clear()
        elif self.extra:
            self.on_set(self, old, row)


class _Positions(dict):
    """name → position; a missing name maps to -1 (so C-level `map` lookups never raise)."""

    __slots__ = ()

    def __missing__(self, key: str) -> int:
        return -1


class FleetView(Sequence[WorkerView]):
    """Worker views in a stable order; `update` replaces one worker's view in O(derived columns)."""

    __slots__ = ("_views", "_pos", "_derived", "_names")

    def __init__(self, views: Iterable[WorkerView] = ()) -> None:
        self._views: list[WorkerView] = []
        self._pos: _Positions = _Positions()
        self._derived: dict[Hashable, tuple[RowFn, Columns]] = {}
        self._names: list[str] | None = None
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

    def get(self, name: str) -> WorkerView | None:
        i = self._pos.get(name)
        return None if i is None else self._views[i]

    def update(self, view: WorkerView) -> None:
        """Replace (or append) the view of `view.name`; cached columns follow."""
        i = self._pos.get(view.name)
        if i is None:
            self._pos[view.name] = len(self._views)
            self._views.append(view)
            self._derived.clear()
            self._names = None
            return
        self._views[i] = view
        for fn, cols in self._derived.values():
            cols._set(i, fn(view))

    def remove(self, name: str) -> None:
        i = self._pos.pop(name, None)
        if i is None:
            return
        del self._views[i]
        self._pos = _Positions((v.name, k) for k, v in enumerate(self._views))
        self._derived.clear()
        self._names = None

    def derived(self, key: Hashable, fn: RowFn, on_set: SetHook | None = None) -> Columns:
        """The columns `fn(view)` for every worker, cached under `key` and kept current by `update`
        (`on_set`: see `Columns`)."""
        hit = self._derived.get(key)
        if hit is not None:
            return hit[1]
        cols = Columns([fn(v) for v in self._views], on_set)
        self._derived[key] = (fn, cols)
        return cols
