"""`kv_events_endpoint: auto` with DP ranks: the subscriber binds rank r on base + r, so all of
base … base + ranks − 1 must be free; a taken port above a random base means another base."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from actors.worker.kv_subscriber import _bind_ranks
from actors.ports import free_port


class ScriptedBase:
    """A real SUB socket whose random base port comes from a script (then from libzmq)."""

    def __init__(self, sock: zmq.Socket, bases: list[int]) -> None:
        self.sock, self.bases = sock, list(bases)

    def bind_to_random_port(self, addr: str, **kw) -> int:
        if self.bases:
            port = self.bases.pop(0)
            self.sock.bind(f"{addr}:{port}")
            return port
        return self.sock.bind_to_random_port(addr, **kw)

    def bind(self, addr: str) -> None:
        self.sock.bind(addr)

    def unbind(self, addr: str) -> None:
        self.sock.unbind(addr)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_taken_port_above_the_base_moves_every_rank_to_another_base():
    ctx = zmq.Context.instance()
    blocker = ctx.socket(zmq.PULL)
    sub = ctx.socket(zmq.SUB)
    try:
        taken_base = free_port(count=3)
        blocker.bind(f"tcp://127.0.0.1:{taken_base + 1}")  # rank 1's port of the first base is taken
        base = _bind_ranks(ScriptedBase(sub, [taken_base]), "127.0.0.1", 3)
        assert base != taken_base
        assert all(_listening(base + r) for r in range(3))
        # released when the base was given up (libzmq's I/O thread closes an unbound listener a moment later)
        deadline = time.monotonic() + 2.0
        while _listening(taken_base) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _listening(taken_base)
    finally:
        blocker.close(0)
        sub.close(0)


def test_consecutive_free_ports_are_all_free():
    base = free_port(count=4)
    for r in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", base + r))  # raises if taken


def test_every_attempt_taken_is_an_error_naming_the_address_in_use():
    ctx = zmq.Context.instance()
    blocker, sub = ctx.socket(zmq.PULL), ctx.socket(zmq.SUB)
    try:
        base = free_port(count=2)
        blocker.bind(f"tcp://127.0.0.1:{base + 1}")
        with pytest.raises(zmq.ZMQError):
            _bind_ranks(ScriptedBase(sub, [base] * 3), "127.0.0.1", 2, attempts=3)
    finally:
        blocker.close(0)
        sub.close(0)
