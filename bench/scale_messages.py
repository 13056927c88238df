"""What `bench.scale`'s emulator and follower-host actors return to the driver (typed, as every
message between processes is). A module of its own: Ray pickles these classes by name, which a
class defined in `python -m bench.scale`'s `__main__` would not allow."""

from __future__ import annotations

import msgspec


class EmulatorCounters(msgspec.Struct, frozen=True):
    """`Emulator.counters()`: reports due, sent, dropped by the link (newest goes next), skipped."""

    offered: int
    sent: int
    coalesced: int
    missed: int


class FollowerTake(msgspec.Struct, frozen=True):
    """`FollowerHost.take()`: the follower's counters, and the freshness samples since the last take."""

    updates: int
    lat_ms: list[float]
    bytes: int
    frames: int
    workers: int
    resyncs: int
    # (worker, applied at, sent at) of every value that became visible, µs since the run's base time
    # (--real-actors: the router's view age at any moment is computed from them)
    seen: list[tuple[str, int, int]] = []
