"""`Stepper`: one engine iteration — take the inbox, schedule, run the forward, complete, publish.

Collaborators, passed in: the scheduler (request state; every change to a request goes through it), the
runner (plan + forward + sampling + commit), the registry (inbox in, progress and endings out), the SLO
policy or None, EOS ids, and `before_forward(rows)` or None (called with a scheduled step's row count
before its forward: the loop thread's team sizing, `thread_sizing.py`). Owns the step lock (one stepping
thread at a time), the kept `StepRecord`s and the running totals (`StepTotals`): it is their one writer.
After each step `ended` says how many requests it ended and `last_seconds` how long it ran (the engine's
arrival window reads them).

`RequestRegistry`: the requests in flight between the submitting threads and the stepping thread.

Owns, guarded by the loop's condition `cv`: the inbox (submitted requests the scheduler has not
taken yet), the handle of every unfinished request, the unfinished requests per session, and the
callbacks to run when a request ends. `on_idle(session_id)` (the engine's: deletes a throwaway
session) is called under `cv` when a session's last unfinished request ends or is refused, before
its handle reads as done. Submitting threads add and cancel; the stepping thread takes
the inbox and publishes progress and endings. A request's own state belongs to the scheduler.

`ThrowawaySessions`: sessions the engine opens for turns without a session id, and deletes after.

Owns: the set of throwaway session keys whose turns have not all ended. It may mutate that set and
the store (it deletes a throwaway session, `keep_shared=True`, when the registry reports that the
session's last turn has ended: `forget`, the registry's `on_idle`). Both methods run under the
engine's condition (`new` takes it; `forget` is called with it held). Steps hold the store lock only
inside the step lock, so deleting here cannot deadlock.

`StepLoop`: who runs an engine's steps, and when. A background thread (`start()`), or, without
one, whichever thread waits on a result (`wait_until` drives the steps itself).

Owns the condition `cv` (the engine's inbox and request registry are guarded by it; it is notified
after every step) and the loop thread. Collaborators, passed in: `step()` runs one engine iteration
(and takes the engine's step lock itself), `has_work()` says whether a step would do anything,
`on_error(e)` is called (with the step lock free) when a background step raised,
`before_start()` runs in the thread that calls `start()` before the loop thread exists,
`on_thread()` runs first on the loop thread (it claims the thread's team sizing, `thread_sizing.py`),
and `after_step()` after each step (the engine's arrival window: it may wait on `cv` for submissions);
`on_wake()` runs on the loop thread when work came while it was idle, before that step (the
engine's burst window: it may wait on `cv` for more submissions); `wake_in()` says in how many seconds
the idle loop looks again without a notify (a warm-up coming due, `warmup.py`; None: only when notified).
Steps driven inline by a waiting thread run none of these hooks.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable

from ..cache.doors.engine import DEFAULT_TENANT, Committed, EngineStore, UnknownSessionError, session_key
from ..profile.correction import StepRows, step_rows
from .request import Request, RequestHandle, RequestOutput, RequestStatus, WorkItem
from .runner import ModelRunner, StepRecord, StepTotals
from .scheduler import Scheduler
from .slo import SloPolicy


class Stepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, requests: RequestRegistry,
                 eos: frozenset[int], slo: SloPolicy | None, ttft_slo: float | None, tpot_slo: float | None,
                 keep_records: int, before_forward: Callable[[int], object] | None = None,
                 before_step: Callable[[], object] | None = None,
                 observe_cost: Callable[[StepRows, float], object] | None = None):
        self.before_forward, self.before_step = before_forward, before_step
        self.observe_cost = observe_cost         # the cost profile's online correction (None: no profile)
        self.scheduler, self.runner, self.requests, self.eos = scheduler, runner, requests, eos
        self.slo, self.ttft_slo, self.tpot_slo = slo, ttft_slo, tpot_slo
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self.totals = StepTotals()
        self.ended = 0                           # requests the last step ended
        self.last_seconds = 0.0                  # how long the last step's forward took (0: it ran none)
        self.lock = threading.Lock()             # one stepping thread at a time

    def step(self) -> StepRecord | None:
        """Run one engine iteration (admit, schedule, forward, sample, publish). Returns what ran."""
        with self.lock:
            if self.before_step is not None:
                self.before_step()
            inbox, cancels = self.requests.take_inbox()
            for r in inbox:
                self.scheduler.add(r)
            self.scheduler.cancel(cancels)
            t0 = time.monotonic()
            items = self.scheduler.schedule()
            record = None
            if items:
                for it in items:
                    it.request.scheduled(t0)
                if self.before_forward is not None:
                    self.before_forward(sum(len(it.new_ids) for it in items))
                committed: Committed | None
                try:
                    _, tokens, committed = self.runner.execute(items)
                except Exception as e:      # the step was aborted: the store is as before
                    items, tokens, committed = self._isolate(items, e)
                # one pass before `complete` changes the requests: each item's record entry, and whether its
                # rows feed a sampled token of a decoding request (decode rows) or are prompt rows
                entries = [(it.request.session_id, len(it.recompute), len(it.new_ids), it.needs_logits)
                           for it in items]
                decode_rows = sum(1 for it, (_, _, n, _) in zip(items, entries) if n and it.request.output_ids)
                rows = step_rows([(it.recompute, it.start, n, bool(it.request.output_ids))
                                  for it, (_, _, n, _) in zip(items, entries)]) \
                    if self.observe_cost is not None and items else None
                if items:
                    self.scheduler.complete(items, tokens, self.eos, committed)
                    record = self.runner.record(self.totals.steps, entries, time.monotonic() - t0, committed)
                    self.records.append(record)
                    self.totals.add_step(record, decode_rows)
                    if self.slo is not None:    # prefill rows = every row but the decode ones
                        self.slo.observe_step(record.num_tokens - decode_rows, decode_rows, record.seconds)
                    if rows is not None and self.observe_cost is not None:
                        self.observe_cost(rows, record.seconds)
            self.last_seconds = record.seconds if record is not None else 0.0
            self._publish(items)
            return record

    def _isolate(self, items, error: Exception) -> tuple[list, list[int], Committed | None]:
        """A step that raised is rerun one request at a time (each plan is aborted on failure, so the
        store is as before every try): only the requests whose own step raises fail, with their own
        error. Returns the items that ran, their sampled tokens, in order, and what their commits
        answered (merged: the last room, every stepped session's turn)."""
        if len(items) == 1:
            self.scheduler.fail([items[0].request], error)
            return [], [], None
        ran, tokens, committed = [], [], None
        for it in items:
            try:
                _, sampled, one = self.runner.execute([it])
            except Exception as e:
                self.scheduler.fail([it.request], e)
            else:
                ran.append(it)
                tokens += sampled
                committed = one if committed is None else \
                    Committed(one.room, {**committed.turns, **one.turns}, one.device_free)
        return ran, tokens, committed

    def _publish(self, items) -> None:
        finished = self.scheduler.drain_finished()
        self.ended = len(finished)
        self.requests.publish(items, finished, self._finished_output)

    def _finished_output(self, r: Request) -> RequestOutput:
        out = self.output(r)
        if self.slo is not None:
            self.slo.observe_finished(r)
        self.totals.add_finished(out)
        return out

    def output(self, r: Request) -> RequestOutput:
        """The caller's view of a request (final once it has ended)."""
        return RequestOutput(r.request_id, r.session_id, tuple(r.output_ids), r.text.text if r.text else None,
                             r.finish_reason, r.metrics(self.ttft_slo, self.tpot_slo), r.error,
                             tuple(r.logprobs) if r.sampling.logprobs is not None else None)

    def forget_totals(self) -> None:
        """Start the totals and kept records afresh (after the engine's warm-up turn, which is not traffic); waits
        for the step in flight."""
        with self.lock:
            self.totals = StepTotals()
            self.records.clear()

    def fail_in_flight(self, error: Exception) -> None:
        """A step raised outside any request's fault (a bug): fail what is in flight, go on."""
        with self.lock:
            self.scheduler.fail([*self.scheduler.running, *self.scheduler.waiting], error)
            self._publish(())


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


class ThrowawaySessions:
    """Throwaway session keys of `store`, guarded by `condition` (the engine's)."""

    def __init__(self, store: EngineStore, condition: threading.Condition):
        self.store, self.condition = store, condition
        self.keys: set[str] = set()          # minted, not yet deleted

    def new(self, tenant: str | None = None) -> str:
        """A fresh session key of `tenant` (default: the default tenant), in no store and not minted before."""
        with self.condition:
            while True:
                key = session_key(tenant or DEFAULT_TENANT, f"~{uuid.uuid4().hex}")
                if key not in self.keys and key not in self.store:
                    self.keys.add(key)
                    return key

    def forget(self, session_id: str) -> None:
        """The registry's on_idle (condition held): delete `session_id` if it is a throwaway session
        (its shared prefix stays findable); a named session is left alone."""
        if session_id in self.keys:
            self.keys.discard(session_id)
            with contextlib.suppress(UnknownSessionError):      # refused before its session was opened
                self.store.delete(session_id, keep_shared=True)


class StepLoop:
    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool],
                 on_error: Callable[[Exception], None], before_start: Callable[[], object] | None = None,
                 on_thread: Callable[[], object] | None = None, after_step: Callable[[], object] | None = None,
                 on_wake: Callable[[], object] | None = None, wake_in: Callable[[], float | None] = lambda: None,
                 name: str = "stateful-hf-engine"):
        self.cv = threading.Condition()
        self._step, self._has_work, self._on_error, self._before_start = step, has_work, on_error, before_start
        self._on_thread, self._after_step, self._on_wake, self._wake_in = on_thread, after_step, on_wake, wake_in
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def notify(self) -> None:
        """Wake every waiter (call with `cv` held)."""
        self.cv.notify_all()

    def wait_until(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait for `pred` (read under no lock; re-checked after every step); drive the steps in this
        thread when no background loop runs. Returns `pred()` at the end (False on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pred():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.running or not self._has_work():
                with self.cv:
                    self.cv.wait_for(pred, timeout=0.05 if left is None else min(left, 0.05))
            else:
                self._step()
        return True

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        with self.cv:
            if self.running:
                return
            if self._before_start is not None:
                self._before_start()
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Run the work in flight to its end (inline if no thread runs), then end the thread."""
        self.wait_until(lambda: not self._has_work(), timeout)
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._on_thread is not None:
            self._on_thread()
        woke = True                         # a loop that starts was idle
        while True:
            with self.cv:
                if self._stopping:
                    return
                if not self._has_work():       # wait for a notify or a warm-up's time, then look again
                    woke = True
                    wake = self._wake_in()
                    self.cv.wait(timeout=None if wake is None else min(wake, threading.TIMEOUT_MAX))
                    continue
            try:
                if woke and self._on_wake is not None:
                    self._on_wake()
                woke = False
                self._step()
                if self._after_step is not None:
                    self._after_step()
            except Exception as e:          # a bug, not a request's fault: the engine fails what is in flight
                self._on_error(e)
