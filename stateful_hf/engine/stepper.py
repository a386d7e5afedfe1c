"""`Stepper`: one engine iteration — take the inbox, schedule, run the forward, complete, publish.

Collaborators, passed in: the scheduler (request state; every change to a request goes through it), the
runner (plan + forward + sampling + commit), the registry (inbox in, progress and endings out), the SLO
policy or None, EOS ids, and `before_forward(rows)` or None (called with a scheduled step's row count
before its forward: the loop thread's team sizing, `thread_sizing.py`). Owns the step lock (one stepping
thread at a time), the kept `StepRecord`s and the running totals (`StepTotals`): it is their one writer.
After each step `ended` says how many requests it ended and `last_seconds` how long it ran (the engine's
arrival window reads them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..cache.doors.engine import Committed
from ..profile.correction import StepRows, step_rows
from .registry import RequestRegistry
from .request import Request, RequestOutput
from .runner import ModelRunner, StepRecord
from .scheduler import Scheduler
from .slo import SloPolicy
from .totals import StepTotals


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
