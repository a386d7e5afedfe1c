"""`RequestRegistry`: the requests in flight between the submitting threads and the stepping thread.

Owns, guarded by the loop's condition `cv`: the inbox (submitted requests the scheduler has not
taken yet), the handle of every unfinished request, the unfinished requests per session, and the
callbacks to run when a request ends. `on_idle(session_id)` (the engine's: deletes a throwaway
session) is called under `cv` when a session's last unfinished request ends or is refused, before
its handle reads as done. Submitting threads add and cancel; the stepping thread takes
the inbox and publishes progress and endings. A request's own state belongs to the scheduler.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable

from .request import Request, RequestHandle, RequestOutput, RequestStatus, WorkItem
from .step_loop import StepLoop


class RequestRegistry:
    def __init__(self, loop: StepLoop, on_idle: Callable[[str], None] | None = None):
        self.loop, self.cv, self._on_idle = loop, loop.cv, on_idle
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []          # asked to end since the loop last took the inbox
        self._handles: dict[int, RequestHandle] = {}
        self._requests: dict[int, Request] = {}
        self._active: Counter[str] = Counter()     # session id -> unfinished requests
        self._on_finish: dict[int, Callable[[RequestOutput], None]] = {}
        self._ids = itertools.count()
        self._queued = 0                           # requests ever queued (add)
        self._queued_at_publish = 0                # ... when the last publish ended

    def new_handle(self, session_id: str) -> RequestHandle:
        """A handle with a fresh request id (nothing registered yet)."""
        return RequestHandle(next(self._ids), session_id, self.loop, self.cancel)

    def add(self, r: Request, handle: RequestHandle, refuse: Callable[[bool], bool]) -> bool:
        """Queue `r` unless `refuse(session has unfinished requests here)` says no (called under `cv`).
        Returns whether it was queued."""
        with self.cv:
            if refuse(bool(self._active[r.session_id])):
                return False
            self._handles[r.request_id], self._requests[r.request_id] = handle, r
            self._active[r.session_id] += 1
            self._inbox.append(r)
            self._queued += 1
            self.cv.notify_all()
        return True

    def reject(self, handle: RequestHandle, r: Request, error: BaseException,
               output: Callable[[Request], RequestOutput]) -> RequestHandle:
        """End a request that was never queued, with `error` on its handle."""
        r.finish(RequestStatus.FAILED, "error", error)
        with self.cv:
            if not self._active[r.session_id]:      # a Counter read inserts nothing
                self._idle(r.session_id)
        handle.publish([], "", 0, output(r))
        return handle

    def _idle(self, session_id: str) -> None:
        if self._on_idle is not None:
            self._on_idle(session_id)

    def has_inbox(self) -> bool:
        return bool(self._inbox)

    def take_inbox(self) -> tuple[list[Request], list[Request]]:
        """The requests submitted and those asked to end since the last call."""
        with self.cv:
            out, self._inbox, cancels, self._cancels = self._inbox, [], self._cancels, []
        return out, cancels

    def cancel(self, request_id: int) -> None:
        """Ask for a request to end after the current step (no-op if it has ended)."""
        with self.cv:
            r = self._requests.get(request_id)
            if r is not None:
                r.request_cancel()
                self._cancels.append(r)
                self.cv.notify_all()

    def cancel_all(self) -> None:
        with self.cv:
            for r in list(self._requests.values()):
                r.request_cancel()
                self._cancels.append(r)

    def when_finished(self, handle: RequestHandle, fn: Callable[[RequestOutput], None]) -> None:
        """Call fn(output) once the request has ended (now, if it has); from the stepping thread it is
        called before the handle reads as done."""
        with self.cv:
            if not handle.done:
                self._on_finish[handle.request_id] = fn
                return
        out = handle.output()
        assert out is not None         # done: its output is set before the handle reads as done
        fn(out)

    def publish(self, items: Iterable[WorkItem], finished: Iterable[Request],
                output: Callable[[Request], RequestOutput]) -> None:
        """The stepping thread, after a step: the tokens (their logprobs, text ends) of the items that
        sampled one, then every finished request's output (`output(r)` also accounts it), its callback
        first; wakes waiters."""
        with self.cv:
            for it in items:
                r = it.request
                if not r.status.done and it.needs_logits:
                    text = r.text.text if r.text else ""
                    ends = r.text.ends if r.text and r.sampling.logprobs is not None else ()   # they align logprobs
                    self._handles[r.request_id].publish(r.output_ids, text, r.text.stable if r.text else 0,
                                                        logprobs=r.logprobs, ends=ends)
            for r in finished:
                if r.text is not None:
                    r.text.finish()
                out = output(r)
                on_finish = self._on_finish.pop(r.request_id, None)
                if on_finish is not None:     # before the handle reads as done (chat: the reply is kept first)
                    on_finish(out)
                self._requests.pop(r.request_id, None)
                self._active[r.session_id] -= 1
                if not self._active[r.session_id]:
                    del self._active[r.session_id]
                    self._idle(r.session_id)    # before the handle reads as done
                ends = r.text.ends if r.text and r.sampling.logprobs is not None else ()
                self._handles.pop(r.request_id).publish(r.output_ids, out.text or "", len(out.text or ""), out,
                                                        out.logprobs or (), ends)
            self._queued_at_publish = self._queued
            self.cv.notify_all()

    def await_burst(self, gap: float, limit: float) -> None:
        """Wait (releasing `cv`) while submissions keep coming: until none was queued for `gap`
        seconds, or `limit` seconds in all."""
        end = time.monotonic() + limit
        with self.cv:
            while True:
                seen, left = self._queued, end - time.monotonic()
                if left <= 0 or not self.cv.wait_for(lambda seen=seen: self._queued != seen,   # type: ignore[misc]
                                                     min(gap, left)):
                    return

    def await_arrivals(self, n: int, timeout: float) -> bool:
        """Wait (releasing `cv`) until `n` requests were queued since the last publish, or `timeout`
        seconds. Returns whether they were."""
        with self.cv:
            return self.cv.wait_for(lambda: self._queued - self._queued_at_publish >= n, timeout)
