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

from .engine_stats import StepTotals
from .registry import RequestRegistry
from .request import Request, RequestOutput
from .runner import ModelRunner, StepRecord
from .scheduler import Scheduler
from .slo import SloPolicy


class Stepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, requests: RequestRegistry,
                 eos: frozenset[int], slo: SloPolicy | None, ttft_slo: float | None, tpot_slo: float | None,
                 keep_records: int, before_forward: Callable[[int], object] | None = None):
        self.before_forward = before_forward
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
            for r in self.requests.take_inbox():
                self.scheduler.add(r)
            t0 = time.monotonic()
            items = self.scheduler.schedule()
            record = None
            if items:
                for it in items:
                    it.request.scheduled_at = it.request.scheduled_at or t0
                if self.before_forward is not None:
                    self.before_forward(sum(len(it.new_ids) for it in items))
                try:
                    _, tokens = self.runner.execute(items)
                except Exception as e:      # the step was aborted: the store is as before
                    items, tokens = self._isolate(items, e)
                # rows feeding a sampled token (decode) vs prompt rows, told apart before `complete`
                decode_rows = sum(1 for it in items if it.request.output_ids and it.new_ids)
                if items:
                    self.scheduler.complete(items, tokens, self.eos)
                    record = self.runner.record(self.totals.steps, items, time.monotonic() - t0)
                    self.records.append(record)
                    self.totals.add_step(items, record, decode_rows)
                    if self.slo is not None:    # prefill rows = every row but the decode ones
                        self.slo.observe_step(record.num_tokens - decode_rows, decode_rows, record.seconds)
            self.last_seconds = record.seconds if record is not None else 0.0
            self._publish(items)
            return record

    def _isolate(self, items, error: Exception) -> tuple[list, list[int]]:
        """A step that raised is rerun one request at a time (each plan is aborted on failure, so the
        store is as before every try): only the requests whose own step raises fail, with their own
        error. Returns the items that ran and their sampled tokens, in order."""
        if len(items) == 1:
            self.scheduler.fail([items[0].request], error)
            return [], []
        ran, tokens = [], []
        for it in items:
            try:
                _, sampled = self.runner.execute([it])
            except Exception as e:
                self.scheduler.fail([it.request], e)
            else:
                ran.append(it)
                tokens += sampled
        return ran, tokens

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

    def fail_in_flight(self, error: Exception) -> None:
        """A step raised outside any request's fault (a bug): fail what is in flight, go on."""
        with self.lock:
            self.scheduler.fail(self.scheduler.running + self.scheduler.waiting, error)
            self._publish(())
