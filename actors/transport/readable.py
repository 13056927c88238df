"""Receive-side wake-ups for ZeroMQ sockets at the cost of one event-loop callback per arrival.

`zmq.asyncio`'s `poll()`/`recv()` build futures, pollers and timers on every call: at tens of
frames a second that is most of what a metrics-plane process spends (measured: 1.1 % of a core for
30 frames/s, against 0.47 % for this). Here the event loop watches the socket's file descriptor and
calls a plain function that drains the socket with non-blocking receives. No Ray import.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq


logger = logging.getLogger("kvroute.readable")


class SocketWatch:
    """Calls `drain()` from the event loop whenever `sock` (a sync socket, receive side only) may
    hold messages. `drain()` receives with `zmq.NOBLOCK` until `zmq.Again`, or stops early and
    returns True to be called again soon (a bounded batch: other tasks run in between). A ZeroMQ
    descriptor signals edges, not levels, so after every call the socket's own `EVENTS` decides
    whether messages are still waiting; `kick()` re-checks after a pause in draining."""

    def __init__(self, sock: zmq.Socket, drain: Callable[[], bool | None],
                 loop: asyncio.AbstractEventLoop | None = None, *, exhaustive: bool = False) -> None:
        self._sock = sock
        self._drain = drain
        # exhaustive: `drain()` returns False only once the socket showed nothing waiting — a receive
        # raised `zmq.Again`, or its own `EVENTS` check lacked POLLIN (it never stops early without
        # saying so). That call already processed the socket's pending commands, which is all an
        # `EVENTS` check here would do, so none is made before or after it: on this VM the first
        # touch of anything after a pause costs ~10x (bench/results/scale.md), and each libzmq call
        # saved is ~10-40 µs per wake-up. A drain that raises gets the `EVENTS` check as before.
        self._exhaustive = exhaustive
        self._loop = loop or asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self._paused = True
        self._closed = False
        self.kick()  # messages that arrived before we watched raise no edge

    def kick(self) -> None:
        """Watch again (after a pause) and drain soon: messages may have arrived unseen."""
        self._resume()
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._on_readable)

    def resume_now(self) -> None:
        """Watch again and drain at once (synchronously), e.g. at the end of a coalescing window."""
        self._resume()
        self._on_readable()

    def pause(self) -> None:
        """Stop watching until `kick()`/`resume_now()` (a resync being fetched, a coalescing window):
        messages wait in the socket. The descriptor leaves the event loop meanwhile — it stays
        readable while messages wait, and a watched one would wake the loop again and again."""
        if not self._paused:
            self._paused = True
            self._remove()

    def close(self) -> None:
        self._closed = True
        self.pause()

    def _resume(self) -> None:
        if self._paused and not self._closed:
            self._paused = False
            self._loop.add_reader(self._fd, self._on_readable)

    def _remove(self) -> None:
        try:
            self._loop.remove_reader(self._fd)
        except (ValueError, OSError, RuntimeError):  # the loop or the descriptor is gone already
            pass

    def _on_readable(self) -> None:
        self._scheduled = False
        if self._paused:
            return
        exhaustive = self._exhaustive
        if not exhaustive:
            try:
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
            except zmq.ZMQError:  # closed under us
                return
        try:
            more = self._drain()
            checked = exhaustive  # returning False, an exhaustive drain has just seen zmq.Again
        except Exception:  # a receive path must never die: log, and look again at the next arrival
            logger.exception("error while draining a socket")
            more, checked = False, False
        if self._paused:
            return
        if not more and not checked:
            try:
                more = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            except zmq.ZMQError:  # closed under us
                return
        if more:
            self._scheduled = True
            self._loop.call_soon(self._on_readable)
