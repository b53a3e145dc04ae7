"""The dispatcher behind ``await Router.admit()``: it holds the waiting requests, nothing more.

Flow control is the core's: it decides whether a request is admitted, queued or refused, and
which queued ticket is released when and why. This module only keeps, for each queued ticket,
the future its ``admit()`` awaits, and follows the core's call protocol (documented on the
Rust type ``kvroute::Admission``):

- **admission**: ``Router._enqueue`` answers admit / queued (a ticket) / rejected; a queued
  ticket gets a future, registered under the dispatcher's lock in the same critical section
  that obtained it, so no release can be taken for a ticket before its waiter exists;
- **dispatch opportunities**: the native router calls :meth:`Dispatcher.opportunity` after
  ``complete``, ``update_metrics*``, ``upsert_endpoint``, ``remove_endpoint``, ``set_healthy``,
  ``reload``, ``tick`` and ``shutdown_queue``; the dispatcher also makes one after each
  admission (an admission may evict a queued request) and on a timer, one per event loop with
  waiting admissions, armed at ``Router.next_flow_deadline()``. Each opportunity takes the
  releases (``Router._take_releases``) and, still under the lock, pops each released ticket's
  waiter: that pop is what ends the ticket on this side;
- **cancellation**: when an awaiting task is cancelled (a client that went away), its
  ``admit()`` pops its own waiter under the lock; if the waiter was still there, no release of
  the ticket has been taken, so ``Router._cancel`` removes it from the core (queued, or
  released and not yet taken). If it was gone, the ticket already ended in a release that was
  taken: nothing is left to remove, and the request is not routed.

Every ticket therefore ends exactly once on this side: by one pop, either at a release or at a
cancellation, both under one lock. Futures are resolved on their own event loop
(``call_soon_threadsafe`` from another thread), so completions and metrics updates may come
from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute._errors import RejectedError
from kvroute._native import now_ms

if TYPE_CHECKING:
    from kvroute._native import Admission, Rejection, Release, Router, _BodyLike, _HeadersLike

__all__ = ["Admitted", "Dispatcher"]

log = logging.getLogger("kvroute.flow")

#: When the core's next deadline is already due as the timer is armed (the deadline may be
#: early, never late), the timer waits 1 ms, then twice as long each time in a row, at most this.
MAX_OVERDUE_BACKOFF_MS = 1000


@dataclass(frozen=True)
class Admitted:
    """``await Router.admit()`` let the request through: route it now (``Router.route``).

    ``ticket`` is the queue ticket it waited on (``None`` when it was admitted at once, and
    always with flow control off); ``waited_ms`` how long it waited in the queue.
    """

    ticket: int | None
    waited_ms: int

    @property
    def queued(self) -> bool:
        """Whether the request waited in the queue."""
        return self.ticket is not None


Admitted.__module__ = "kvroute"  # shown (and pickled) as kvroute.Admitted


class _Waiter:
    """The future one queued ``admit()`` awaits, and its event loop."""

    __slots__ = ("future", "loop")

    def __init__(self, future: asyncio.Future[Release], loop: asyncio.AbstractEventLoop) -> None:
        self.future = future
        self.loop = loop


class _LoopTimer:
    """One event loop's waiting admissions and its timer (touched on that loop's thread only,
    under the dispatcher's lock)."""

    __slots__ = ("waiters", "handle", "due_ms", "backoff_ms")

    def __init__(self) -> None:
        self.waiters = 0
        self.handle: asyncio.TimerHandle | None = None
        self.due_ms: int | None = None
        self.backoff_ms = 1

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.handle = None
        self.due_ms = None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(future: asyncio.Future[Release], release: Release) -> None:
    if not future.done():  # a cancelled waiter's future: its ticket ended in this release
        future.set_result(release)


def _rejected(rejection: Rejection, waited_ms: int, ticket: int | None) -> RejectedError:
    return RejectedError.of(rejection.status, rejection.reason, waited_ms=waited_ms, ticket=ticket)


class Dispatcher:
    """The waiting admissions of one router (made by the router on its first ``admit()``).

    ``clock`` (milliseconds, default :func:`kvroute.now_ms`) is the time of the opportunities
    the dispatcher makes itself and the reference of its timer; the router passes its
    ``flow_clock``.
    """

    def __init__(self, router: Router, clock: Callable[[], int] | None = None) -> None:
        # A weak reference: the router holds the dispatcher (an awaiting admit() holds the
        # router itself).
        self._router: weakref.ref[Router] = weakref.ref(router)
        self.clock: Callable[[], int] = clock if clock is not None else now_ms
        # Reentrant: a coroutine finalized by the garbage collector while this thread holds
        # the lock abandons its ticket under it.
        self._lock = threading.RLock()
        self._waiters: dict[int, _Waiter] = {}
        self._loops: dict[asyncio.AbstractEventLoop, _LoopTimer] = {}
        #: Cancelled admissions whose ticket was removed from the queue.
        self.cancelled = 0
        #: Cancelled admissions whose ticket had already been released (dispatched or dropped).
        self.cancelled_after_release = 0
        #: Timer firings (tests check that the timer does not spin).
        self.timer_fired = 0

    # ----------------------------------------------------------------------------------------
    # views
    # ----------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Admissions waiting for their ticket's release."""
        return len(self._waiters)

    def tickets(self) -> list[int]:
        """The tickets of the waiting admissions."""
        with self._lock:
            return sorted(self._waiters)

    def timers(self) -> int:
        """Event loops with an armed timer (a closed loop's is dropped: it can never fire)."""
        with self._lock:
            self._drop_closed()
            return sum(1 for t in self._loops.values() if t.handle is not None)

    def _drop_closed(self) -> None:
        """Under the lock: forget the loops that closed with nobody waiting on them. A release
        taken on another thread just before a loop closed schedules that loop's re-arm, which
        a closed loop never runs, so its last timer would stay behind."""
        for loop in [loop for loop, t in self._loops.items() if t.waiters == 0 and loop.is_closed()]:
            self._loops.pop(loop).disarm()

    # ----------------------------------------------------------------------------------------
    # admission
    # ----------------------------------------------------------------------------------------

    async def admit(
        self, router: Router, body: _BodyLike, headers: _HeadersLike | None, now: int | None
    ) -> Admitted:
        """``Router.admit``: wait until the core releases the request, or raise its rejection."""
        loop = asyncio.get_running_loop()
        at = self._now(now)
        # Made before the ticket exists, so that nothing can fail between the two.
        future: asyncio.Future[Release] = loop.create_future()
        with self._lock:
            admission: Admission = router._enqueue(body, headers, at)  # RequestError: nothing held
            ticket = admission.ticket
            if ticket is not None:
                self._register(ticket, future, loop)
            # The admission may have evicted a queued request: hand it its release now.
            ended = self._take(router, at) if self._waiters else []
        if ticket is None:
            self._settle(ended)
            self._rearm()
            if admission.rejection is not None:
                raise _rejected(admission.rejection, 0, None)
            return Admitted(None, 0)
        try:
            self._settle(ended)
            self._rearm()
            release = await future
        except BaseException:  # cancelled (the client went away), the coroutine closed, a bug
            self._abandon(router, ticket)
            raise
        if release.rejection is not None:
            raise _rejected(release.rejection, release.waited_ms, ticket)
        return Admitted(ticket, release.waited_ms)

    def opportunity(self, now: int | None = None) -> None:
        """A dispatch opportunity at ``now`` (default: the clock): take the releases and wake
        their waiters. Called by the router after every change that may free capacity."""
        if not self._waiters:
            # Every ticket of this router has a waiter from the moment it exists (the
            # registration is under the lock with the enqueue, and an admission takes the
            # releases itself after registering): none waiting, none held.
            return
        router = self._router()
        if router is None:
            return
        at = self._now(now)
        with self._lock:
            ended = self._take(router, at)
        self._settle(ended)
        self._rearm()

    # ----------------------------------------------------------------------------------------
    # internals
    # ----------------------------------------------------------------------------------------

    def _now(self, now: int | None) -> int:
        return int(self.clock()) if now is None else now

    def _register(self, ticket: int, future: asyncio.Future[Release], loop: asyncio.AbstractEventLoop) -> None:
        """Under the lock."""
        self._waiters[ticket] = _Waiter(future, loop)
        timer = self._loops.get(loop)
        if timer is None:
            timer = self._loops[loop] = _LoopTimer()
        timer.waiters += 1

    def _pop(self, ticket: int) -> _Waiter | None:
        """Under the lock: end the ticket on this side (at a release or a cancellation)."""
        waiter = self._waiters.pop(ticket, None)
        if waiter is not None:
            self._loops[waiter.loop].waiters -= 1
        return waiter

    def _take(self, router: Router, now: int) -> list[tuple[_Waiter, Release]]:
        """Under the lock: a dispatch opportunity, and the waiter of each release."""
        ended: list[tuple[_Waiter, Release]] = []
        for release in router._take_releases(now):
            waiter = self._pop(release.ticket)
            if waiter is None:  # cannot happen: every ticket is registered as it is issued
                log.error("flow control released ticket %d, which no admission holds", release.ticket)
                continue
            ended.append((waiter, release))
        return ended

    def _settle(self, ended: list[tuple[_Waiter, Release]]) -> None:
        """Resolve each waiter's future on its own loop (outside the lock)."""
        if not ended:
            return
        running = _running_loop()
        for waiter, release in ended:
            if waiter.loop is running:
                _resolve(waiter.future, release)
                continue
            try:
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future, release)
            except RuntimeError:  # that loop is closed: nothing awaits there any more
                pass

    def _abandon(self, router: Router, ticket: int) -> None:
        """The admission of ``ticket`` stopped waiting before it saw its release."""
        with self._lock:
            waiter = self._pop(ticket)
            if waiter is None:
                # Its release was taken first: the ticket ended there. A dispatched request
                # that is not routed counts as load until the core's grace lapses.
                self.cancelled_after_release += 1
                removed = True
            else:
                removed = router._cancel(ticket)
                self.cancelled += 1
        if not removed:  # cannot happen: only this pop ends a ticket whose release was not taken
            log.error("flow control did not hold ticket %d at its cancellation", ticket)
        self._rearm()

    def _rearm(self) -> None:
        """Re-arm (or drop) the timer of every loop with waiters, each on its own thread."""
        running = _running_loop()
        with self._lock:
            self._drop_closed()
            loops = list(self._loops)
        for loop in loops:
            if loop is running:
                self._arm(loop)
                continue
            try:
                loop.call_soon_threadsafe(self._arm, loop)
            except RuntimeError:  # closed: its timer can never fire
                with self._lock:
                    timer = self._loops.get(loop)
                    if timer is not None and timer.waiters == 0:
                        del self._loops[loop]

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``'s thread: arm its timer for the core's next deadline (or drop it)."""
        router = self._router()
        with self._lock:
            timer = self._loops.get(loop)
            if timer is None:
                return
            if timer.waiters == 0 or router is None:
                timer.disarm()
                del self._loops[loop]
                return
            deadline = router.next_flow_deadline()
            if deadline is None:  # nothing will happen on its own: completions will come
                timer.disarm()
                return
            if timer.handle is not None and timer.due_ms is not None and timer.due_ms <= deadline:
                return  # armed for this deadline or an earlier one (it re-arms when it fires)
            delay_ms = deadline - self._now(None)
            if delay_ms > 0:
                timer.backoff_ms = 1
            else:
                delay_ms = timer.backoff_ms
                timer.backoff_ms = min(2 * timer.backoff_ms, MAX_OVERDUE_BACKOFF_MS)
            timer.disarm()
            timer.handle = loop.call_at(loop.time() + delay_ms / 1000, self._fire, loop)
            timer.due_ms = deadline

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self.timer_fired += 1
            timer = self._loops.get(loop)
            if timer is not None:
                timer.handle = None
                timer.due_ms = None
        self.opportunity(None)
        # No waiters left anywhere: opportunity() returned early; drop this loop's entry.
        self._arm(loop)
