"""When a metrics pipeline pushes toward the aggregator, written once: throttled on both edges over
`Settings.coalesce_s`, plus a push loop for heartbeats, woken changes and reconnection.

The base of a worker's pipeline (`actors.worker.metrics_pipe.MetricsPipe`), which says how it
receives (`_pause_receive` / `_resume_receive` / `_drain_waiting`) and what one push is
(`_push_now`). No Ray import.

- The window is `Settings.coalesce_s`.
- The first change after a window without a push goes at once, from the receive callback itself
  (no hand-off to the push loop).
- After that a coalescing window starts: the receive watches sleep (SGLang's frames wait in their
  sockets; the process is not woken per frame) and at its end one push carries the newest state.
  While changes keep coming the pipeline stays in windows (one wake-up and one push per
  `coalesce_s`); once a window stays empty, receiving wakes on arrival again.
- The push loop sends the newest state every `heartbeat_s` (counted from the last push, wherever it
  came from) or at once when `wake` is set (a liveness or status change), and reconnects the link.
  A push never waits on the aggregator: a frame the link cannot queue is dropped and the next,
  newer state goes instead.
"""

from __future__ import annotations

import asyncio
import logging
import time

from actors.transport.link import AggregatorLink
from actors.models import Settings

logger = logging.getLogger("kvroute.push")


class PushWindow:
    """The push side of a metrics pipeline (see the module docstring); subclasses receive."""

    def __init__(self, what: str, link: AggregatorLink, settings: Settings, wake: asyncio.Event | None = None,
                 heartbeat_s: float | None = None) -> None:
        self.what = what  # "worker w0", for logs
        self.link = link
        self.settings = settings
        self.heartbeat_s = heartbeat_s or settings.heartbeat_s
        self.wake = wake if wake is not None else asyncio.Event()
        self._last_push = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._stopping = False

    # --- what a pipeline provides ---------------------------------------------------------------

    def _pause_receive(self) -> None:
        """Stop waking on arrivals (a window is open)."""

    def _resume_receive(self) -> None:
        """Wake on arrivals again (a window stayed empty)."""

    def _drain_waiting(self) -> None:
        """Ingest what waited in the sockets during the window (no `_metrics_arrived` from it)."""

    def _unpushed(self) -> bool:
        """Something changed since the last push that was queued."""
        raise NotImplementedError

    def _push_now(self) -> bool:
        """One push of the newest state if the link is ready; True if it was queued."""
        raise NotImplementedError

    # --- the windows ----------------------------------------------------------------------------

    def window_s(self) -> float:
        """The coalescing window."""
        return self.settings.coalesce_s

    def _metrics_arrived(self) -> None:
        """New metrics, throttled on both edges (see the module docstring)."""
        if self._timer is not None:
            return
        if time.monotonic() - self._last_push >= self.window_s() and self._push_now():
            return
        self._start_window()

    def _start_window(self) -> None:
        self._pause_receive()
        wait = max(self.window_s() - (time.monotonic() - self._last_push), self.settings.push_interval_s)
        self._timer = asyncio.get_running_loop().call_later(wait, self._window_ends)

    def _window_ends(self) -> None:
        self._timer = None
        if self._stopping:
            return
        self._drain_waiting()
        if self._unpushed():
            self._push_now()  # if it is not queued, the next window (or the push loop) sends the newest
            self._start_window()
        else:
            self._resume_receive()

    def _stop_windows(self) -> bool:
        """No push after this; False if already stopped."""
        if self._stopping:
            return False
        self._stopping = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return True

    # --- heartbeats, woken changes, reconnection ------------------------------------------------

    async def _push_loop(self) -> None:
        s = self.settings
        while not self._stopping:  # (a push after stop changes nothing: the loop must not spin on it)
            try:
                wait = self.heartbeat_s - (time.monotonic() - self._last_push)
                if wait > 0 and not self.wake.is_set():
                    try:
                        await asyncio.wait_for(self.wake.wait(), timeout=wait)
                    except asyncio.TimeoutError:
                        continue  # re-check: the receive path may have pushed meanwhile
                gap = s.push_interval_s - (time.monotonic() - self._last_push)
                if gap > 0:
                    await asyncio.sleep(gap)
                if not await self.link.ensure():
                    await asyncio.sleep(min(s.reconnect_backoff_s, s.heartbeat_s))
                    continue
                self.wake.clear()
                if not self._push_now():
                    self.wake.set()  # not queued: send the newest state again after the gap
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("%s: push loop error", self.what)
                await asyncio.sleep(s.push_interval_s)
