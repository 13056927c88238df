"""Stand-ins for the Ray handle methods the metrics plane calls (`handle.method.remote(*args)`), for
tests that run the real sockets without Ray."""

from __future__ import annotations

from typing import Any, Callable


class Remote:
    """`handle.name = Remote(fn)`: `handle.name.remote(*args)` returns `fn(*args)` (a coroutine when
    `fn` is async, awaited by the caller as Ray's ObjectRef would be)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)
