"""`SessionQueue`: a replica's turns of one session run one at a time, in arrival order.

A turn takes its session's slot before it is submitted to the engine and gives it back when the
engine has ended the request (finished, failed, or cancelled after its client left), so the engine
never sees two turns of one session at once. A turn that cannot get the slot within `timeout`
seconds is refused with HTTP 409 and `Retry-After: 1`.

Lives on the replica's event loop: `acquire` is a coroutine; `release` may be called from any thread.
"""

from __future__ import annotations

import asyncio
from collections import deque

from .protocol import APIError


class _Slot:
    __slots__ = ("held", "waiters")

    def __init__(self) -> None:
        self.held = False
        self.waiters: deque[asyncio.Future] = deque()     # FIFO: arrival order


class SessionQueue:
    def __init__(self, timeout: float = 30.0):
        if not timeout > 0:
            raise ValueError(f"the session wait timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self._slots: dict[str, _Slot] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def busy(self, session_id: str) -> bool:
        """A turn of the session holds its slot or waits for it."""
        return session_id in self._slots

    def waiting(self, session_id: str) -> int:
        slot = self._slots.get(session_id)
        return 0 if slot is None else len(slot.waiters)

    async def acquire(self, session_id: str) -> None:
        """Wait for the session's slot (FIFO). Raises APIError 409 after `timeout` seconds."""
        self._loop = asyncio.get_running_loop()
        slot = self._slots.setdefault(session_id, _Slot())
        if not slot.held and not slot.waiters:
            slot.held = True
            return
        fut = self._loop.create_future()
        slot.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():      # handed the slot just as we gave up: pass it on
                self._handoff(session_id)
            else:
                fut.cancel()
                slot.waiters.remove(fut)
                self._drop_if_idle(session_id)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise APIError(409, f"session {session_id!r} has a turn in flight and this turn waited "
                           f"{self.timeout:g} s for it; retry when it has finished", param="session_id",
                           code="session_busy", retry_after=1) from None

    def release(self, session_id: str) -> None:
        """Give the slot to the next waiting turn (thread-safe)."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._handoff(session_id)
        else:
            loop.call_soon_threadsafe(self._handoff, session_id)

    def _handoff(self, session_id: str) -> None:
        slot = self._slots.get(session_id)
        if slot is None:
            return
        while slot.waiters:
            fut = slot.waiters.popleft()
            if not fut.cancelled():
                fut.set_result(None)        # slot.held stays True: it passes to this waiter
                return
        slot.held = False
        self._drop_if_idle(session_id)

    def _drop_if_idle(self, session_id: str) -> None:
        slot = self._slots.get(session_id)
        if slot is not None and not slot.held and not slot.waiters:
            del self._slots[session_id]
