"""Shared by the RouterCore tests: a settable clock and a follower that never reaches an aggregator."""

from __future__ import annotations

from typing import Any


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def unused_aggregator() -> Any:
    raise AssertionError("not following an aggregator here")
