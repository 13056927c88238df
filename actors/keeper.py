"""The keeper of one managed engine: a small plain process (no Ray) between the actor that owns a
worker and its engine, so that the engine can outlive its owner's restart.

    python -m actors.keeper --control PATH --grace-s G --stop-grace-s S -- ENGINE ARGV…

It detaches first (forks; the command returns once the keeper listens, exit 0, or 1 if it could not
start): a Ray worker kills its direct children when it exits (`RAY_kill_child_processes_on_worker_exit`,
on by default), so the keeper must not be one. (With `RAY_kill_child_processes_on_worker_exit_with_
raylet_subreaper=1` Ray kills every descendant: engines then stop with their owner and a restarted
owner launches them again.) It starts the engine as its child (own process group; SIGTERM if the
keeper dies) and listens on a Unix socket at PATH, in a directory only its user can enter. An owner
connects and is told the engine's and the keeper's pids (`{"pid": …, "keeper": …}`), and, when the
engine exits, its exit code (`{"exit": …}`); then the keeper exits too. The owner may send `stop` (SIGTERM to the engine's group, SIGKILL after S seconds). When
no owner is connected for G seconds — its actor died and no restarted incarnation adopted the engine
by connecting again — the keeper kills the engine's group (SIGKILL): nothing outlives its owner for
long (G = 0: at once, as Ray killing a dead actor's children would). Lines of JSON out, the one word `stop` in; nothing read from
the socket is ever executed or evaluated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile

CONTROL_DIR_MODE = 0o700
FIRST_OWNER_S = 30.0  # the launcher connects within milliseconds; a keeper nobody reaches stops its engine


def control_dir() -> str:
    """The directory of the keepers' sockets: per user, mode 0700 (only the owner's user may connect)."""
    path = os.path.join(tempfile.gettempdir(), f"kvroute-keepers-{os.getuid()}")
    os.makedirs(path, mode=CONTROL_DIR_MODE, exist_ok=True)
    os.chmod(path, CONTROL_DIR_MODE)
    return path


def _die_with_parent() -> None:
    """In the engine, before exec: SIGTERM if the keeper dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Keeper:
    def __init__(self, control: str, cmd: list[str], grace_s: float, stop_grace_s: float) -> None:
        self.control, self.cmd = control, cmd
        self.grace_s, self.stop_grace_s = grace_s, stop_grace_s
        self.proc: asyncio.subprocess.Process | None = None
        self.owners: set[asyncio.StreamWriter] = set()
        self._orphaned: asyncio.TimerHandle | None = None
        self._stopping: asyncio.Task | None = None

    async def run(self, started: int | None = None) -> int:
        """Serve until the engine exits; `started`: a pipe to write one byte to once it runs."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        server = await asyncio.start_unix_server(self._owner, path=self.control)
        os.chmod(self.control, 0o600)
        try:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self.cmd, stdin=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as exc:
                print(f"kvroute keeper: cannot start {self.cmd[0]}: {exc}", file=sys.stderr, flush=True)
                return 127
            if started is not None:
                os.write(started, b"1")
                os.close(started)
            self._orphan(max(self.grace_s, FIRST_OWNER_S))  # until its launcher connects
            code = await self.proc.wait()
            server.close()  # no owner may adopt a dead engine
            with contextlib.suppress(OSError):
                os.unlink(self.control)
            for w in list(self.owners):
                with contextlib.suppress(Exception):
                    w.write((json.dumps({"exit": code}) + "\n").encode())
                    await w.drain()
                    w.close()
            return 0
        finally:
            server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.control)

    async def _owner(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping is not None or (self.proc is not None and self.proc.returncode is not None):
            writer.close()  # stopping, or stopped: nothing to adopt
            return
        if self._orphaned is not None:
            self._orphaned.cancel()
            self._orphaned = None
        self.owners.add(writer)
        try:
            while self.proc is None:
                await asyncio.sleep(0.01)
            writer.write((json.dumps({"pid": self.proc.pid, "keeper": os.getpid()}) + "\n").encode())
            await writer.drain()
            while line := await reader.readline():
                if line.strip() == b"stop":
                    self.stop()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the owner went away, or the keeper is ending
        finally:
            self.owners.discard(writer)
            if not self.owners:
                self._orphan()

    def _orphan(self, wait_s: float | None = None) -> None:
        if self._orphaned is None and self._stopping is None:
            self._orphaned = asyncio.get_running_loop().call_later(
                self.grace_s if wait_s is None else wait_s, self.stop, True)

    def stop(self, now: bool = False) -> None:
        """Stop the engine: SIGTERM, SIGKILL after the stop grace; `now` (nobody owns it): SIGKILL at
        once — a draining engine would answer the requests routers still send it with errors, a dead
        one refuses the connection and they retry elsewhere, as when Ray killed an actor's engine."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(now))

    async def _stop(self, now: bool) -> None:
        proc = self.proc
        if proc is None:
            return
        steps = ((signal.SIGKILL, 5.0),) if now else ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 5.0))
        for sig, wait in steps:
            if proc.returncode is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), wait)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.keeper", description=__doc__.split("\n\n")[0])
    p.add_argument("--control", required=True, help="the Unix socket path owners connect to")
    p.add_argument("--grace-s", type=float, default=0.0, help="how long the engine outlives its last owner")
    p.add_argument("--stop-grace-s", type=float, default=5.0, help="SIGTERM → SIGKILL delay")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the engine's argv")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no engine command after --")
    read, write = os.pipe()
    if os.fork():  # the launcher's child: returns once the detached keeper runs the engine
        os.close(write)
        ok = os.read(read, 1) == b"1"
        return 0 if ok else 1
    os.close(read)
    os.setsid()
    return asyncio.run(Keeper(a.control, cmd, a.grace_s, a.stop_grace_s).run(started=write))


if __name__ == "__main__":
    sys.exit(main())
