"""The scheduler: the one owner of request state. Iteration-level, a per-step token budget, short turns first.

Every step it (1) continues running requests oldest first (a decode token each, then chunks of
their prefills and recomputations), suspending the latest-arrived ones when their session blocks
do not fit; (2) admits queued requests while more than a reserve of device blocks stays available
and, with an SLO policy, while the queued prefills' predicted time fits in the running decodes'
smallest TPOT slack (`slo.py`). With layer-wise allocation (its part `LayerwiseScheduling`,
`layer_offload.py`; `AllLayers` without) a prefill that does not fit with all layers is admitted keeping
fewer layers on the device, and a running request short of blocks has its layers pushed down to the host
before anyone is suspended.

Order within a step (what keeps a returning turn's first token from waiting behind long prompts):
decode tokens first; then queued *short* turns (at most `short_prefill_tokens` rows before their first
token: a returning session's new message) take budget before running long prefills continue (the
rows they need are set aside from the running prefills' share, which keeps at least one chunk so a
long prefill always progresses); admission goes short turns first, then the rest, each kind in
arrival order, but never a session's later turn before its earlier one (they run in submit order);
a head of line that does not fit in the device blocks stops admission for the step.
The store owns KV state; the scheduler asks it once per turn (`turn_needs`), admits (`begin`), ends
(`end`), and per step plans and commits (the runner); `room()` only when it holds no fresh `Room`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sortedcontainers import SortedKeyList

from ..cache.doors.engine import Committed, EngineStore, Room
from .admission import Admission, AdmissionPolicy, Gate, Verdict, no_device_room, no_host_slots
from .layer_offload import AllLayers, LayerScheduling, PushDown
from .request import Request, RequestStatus, WorkItem, blocks_needed, next_item
from .slo import SloPolicy


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_tokens: int = 512        # rows per forward (prompt chunks + recomputed + decode tokens)
    max_num_seqs: int = 128            # running requests at most
    reserve_fraction: float = 0.1      # admit only while more than this share of device blocks is available
    short_prefill_tokens: int | None = None    # a turn this short is served first; None: max_batch_tokens // 4; 0: FCFS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.short_prefill_tokens is not None and self.short_prefill_tokens < 0:
            raise ValueError(f"short_prefill_tokens must be >= 0 or None, got {self.short_prefill_tokens}")

    @property
    def short_rows(self) -> int:
        """Rows before the first token at or below which a turn is short."""
        return self.max_batch_tokens // 4 if self.short_prefill_tokens is None else self.short_prefill_tokens


class Scheduler:
    def __init__(self, store: EngineStore, config: SchedulerConfig, max_positions: int,
                 slo: SloPolicy | None = None, layers: LayerScheduling | None = None):
        if config.max_batch_tokens < store.block_size:
            raise ValueError(f"max_batch_tokens ({config.max_batch_tokens}) must be >= the store's chunk size "
                             f"({store.block_size}): recomputation goes by whole chunks")
        self.store, self.config, self.max_positions, self.slo = store, config, max_positions, slo
        # WAITING and SUSPENDED: short turns first, each kind by arrival (`r.short` is fixed while queued)
        self.waiting = SortedKeyList(key=_admit_order)
        self._queued: dict[str, list[Request]] = {}   # per session, its queued turns by arrival
        self._cancels: list[Request] = []   # asked to end, not yet queued here
        self.running: list[Request] = []    # RUNNING, by arrival
        self.finished: list[Request] = []   # ended since the engine last drained them
        self.room: Room | None = None       # the store's room as the last commit or end left it; None: ask
        self.passes = 0                     # schedule() calls so far
        self.epoch = 0                      # store changes this scheduler made that can move idle sessions' chunks
        # the layer-wise part (layer_offload.py): LayerKV's decisions, or every layer on the device
        self.layers: LayerScheduling = layers or AllLayers(store)
        self.admission = Admission(store, self.layers, self.running)
        self.policy = AdmissionPolicy(store, slo)   # warm-ups and the SLO, before admission weighs a request

    # ---- queue ----------------------------------------------------------------------------------

    def add(self, r: Request) -> None:
        # asked for the coming pass, which admits with it unless the store moves
        answer = self.admission.ask(r, (self.passes + 1, self.epoch))
        r.asked(answer.needs, answer.pass_)
        r.mark_short(self._is_short(r))
        self._queue(r)

    def _queue(self, r: Request) -> None:
        self.waiting.add(r)
        bisect.insort(self._queued.setdefault(r.session_id, []), r, key=_order)

    def _unqueue(self, r: Request) -> None:
        self.waiting.remove(r)
        turns = self._queued[r.session_id]
        turns.remove(r)
        if not turns:
            del self._queued[r.session_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def finish(self, r: Request, status: RequestStatus, reason: str, error: BaseException | None = None) -> Room | None:
        """End a request in any state: end its turn in the store (the lease), leave the queues. Returns
        the room after, if it held a lease."""
        if r.status.done:
            return None
        room = None
        if r.leased:
            room = self.store.end(r.session_id, len(r.output_ids))    # the rest of last_turn: the store's
            r.release()
            self.epoch += 1            # the release may have moved idle sessions' chunks (ahead-of-time swap-out)
        if r in self.waiting:
            self._unqueue(r)
        elif r in self.running:
            self.running.remove(r)
        r.finish(status, reason, error)
        self.finished.append(r)
        return room

    def _fail(self, r: Request, error: Exception) -> int:
        """Fail `r` and release what it held; returns the device blocks that made available (its
        session's blocks become an idle session's, which a later admission in this pass may take)."""
        before = self.store.room().device_blocks if r.leased else 0
        room = self.finish(r, RequestStatus.FAILED, "error", error)
        return 0 if room is None else max(room.device_blocks - before, 0)

    def cancel(self, requests: Iterable[Request]) -> None:
        """These requests were asked to end (`cancel_requested`): they end at the next pass, or once queued."""
        self._cancels.extend(requests)

    def reap_cancelled(self) -> None:
        """End the requests asked to end that are queued or running; O(those), whatever the queue's length."""
        later = []
        for r in self._cancels:
            if r in self.waiting or r in self.running:
                self.finish(r, RequestStatus.CANCELLED, "cancelled")
                self.room = None
            elif not r.status.done:    # still in the engine's inbox: queued with the next `add`
                later.append(r)
        self._cancels = later

    def _is_short(self, r: Request) -> bool:
        """At most `short_rows` rows before its first token (an estimate when queued: for ordering only)."""
        return self.config.short_rows > 0 and r.prefill_rows() <= self.config.short_rows

    def _set_aside(self, room: int) -> int:
        """Rows of `room` kept from running long prefills for short turns: the rest of running ones'
        and all of queued ones whose sessions are not busy here, leaving the long ones at least one chunk."""
        if not any(not r.decoding and not r.short for r in self.running):
            return 0
        busy, cap = {q.session_id for q in self.running}, room - self.store.block_size
        rows = sum(len(r.pending) + len(r.missing) for r in self.running if r.short and not r.decoding)
        for r in self.waiting:         # short ones first: stop at the first long one, or once it is all
            if not r.short or rows >= cap:
                break
            rows += r.prefill_rows() if r.session_id not in busy else 0
        return max(min(rows, cap), 0)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> list[WorkItem]:
        self.passes += 1
        self.reap_cancelled()
        for q in self.policy.yielding(self.waiting[0] if self.waiting else None, self.running):
            self.finish(q, RequestStatus.CANCELLED, "yielded")       # a turn is queued: warm-ups yield their blocks
            self.room = None
        budget, bs = self.config.max_batch_tokens, self.store.block_size
        reserve = math.ceil(self.config.reserve_fraction * self.store.pool_sizes.device_blocks)
        room, self.room = self.room or self.store.room(), None      # consumed: a commit or end leaves the next
        if pushed := self.layers.project(self.running, room.device_blocks, reserve):
            self._pushed(pushed)
            room = self.store.room()                                 # layers were pushed down
        avail, slots = room.device_blocks, room.device_slots
        host_taken = 0                 # host slots this pass's items fill (push-downs take theirs at once)
        items: list[WorkItem] = []
        starved: list[Request] = []    # running layer-wise requests the host tier had no slot for
        # (1) running requests, oldest first; decode tokens and short turns' rows are counted out of
        # the budget before long prefills take theirs.
        prefill_budget = budget - sum(r.decoding for r in self.running)
        prefill_budget -= self._set_aside(prefill_budget)
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            tokens = 1 if r.decoding else budget if r.short else min(prefill_budget, budget)
            item = next_item(r, tokens, r.length, bs) if tokens > 0 else None
            if item is None:
                i += 1
                continue
            need = blocks_needed(item)
            if need > avail:           # push layers down before suspending anyone (LayerKV)
                cut, pushed = self.layers.make_room(r, item, need, avail, self.running[i + 1:])
                avail += self._pushed(pushed)
                if cut is not item:
                    item, need = cut, blocks_needed(cut)
            while need > avail and self.running[-1] is not r:
                avail += self._suspend(self.running[-1])
            if need > avail:
                if i == 0:             # what it held counts for the requests after it in this pass
                    avail += self._fail(r, no_device_room(r, need, avail, bs, self.layers.room_hint, more=True))
                else:
                    avail += self._suspend(r)
                continue
            fitted = self.layers.fit_host(r, item, host_taken)
            if fitted is None:         # waits for host slots; its device blocks stay unspent
                starved.append(r)
                i += 1
                continue
            if fitted is not item:
                item, need = fitted, blocks_needed(fitted)
            avail -= need
            host_taken += self.layers.host_needed(r, item)
            budget -= item.num_tokens
            if not r.decoding and not r.short:
                prefill_budget -= item.num_tokens
            items.append(item)
            i += 1
        if starved and not items:      # no one can move: the oldest starved request fails alone
            r = starved[0]
            avail += self._fail(r, no_host_slots(r))
        # (2) admission, short turns first, while more than the reserve stays available and (SLO
        # policy) the admitted prefills' predicted seconds fit in min_i slack_i of the running decodes.
        committed = self.layers.committed(self.running, items)
        host_committed = self.layers.host_committed(self.running, items)
        allowance = self.policy.allowance(self.running)
        after = None                   # the queue in admission order: O(what a pass admits or skips + log queued)
        while (i := 0 if after is None else self.waiting.bisect_key_right(after)) < len(self.waiting):
            r = self.waiting[i]
            after = _admit_order(r)    # the next is found again past r, whatever this pass removed
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._queued[r.session_id][0] is not r:   # one session's turns run in submit order, short or not
                continue
            gate, cost = self.policy.gate(r, len(self._queued[r.session_id]), allowance)
            if gate is Gate.SUPERSEDED:
                self.finish(r, RequestStatus.CANCELLED, "superseded")
                continue
            if gate is Gate.DEFER:     # strict order: nothing after it either
                break
            verdict = self.admission.admit(r, budget, avail, reserve, first=not items, pass_=(self.passes, self.epoch),
                                           slots=slots, committed=committed,
                                           host_avail=self.layers.host_left(host_taken) - host_committed)
            avail += self._apply(r, verdict)   # blocks a request failed in admission gave back
            if verdict.item is None:
                if not verdict.skip:   # head of line does not fit: strict order, stop here
                    break
                continue               # its session is busy with an earlier turn, or it failed: let later ones pass
            item = verdict.item
            avail -= verdict.blocks
            slots = None if slots is None else slots - 1     # its session claims a slot or keeps its own
            host_taken += self.layers.host_needed(r, item)
            committed += self.layers.future_blocks(r, item)
            host_committed += self.layers.future_host(r, item)
            allowance -= cost
            budget -= item.num_tokens
            items.append(item)
        if not items:                  # nothing runs, so no commit tells what changed: ask next time
            self.room = None
        return items

    def _apply(self, r: Request, verdict: Verdict) -> int:
        """Apply admission's verdict to `r`: the store's latest answer about it; then fail it, or start it
        (its rows, keep factor, turn) in the running list. Returns the device blocks a failure made available."""
        if verdict.answer is not None:
            r.asked(verdict.answer.needs, verdict.answer.pass_)
        if verdict.error is not None:
            return self._fail(r, verdict.error)
        if verdict.item is None:
            return 0
        if verdict.rows is not None:
            r.prepare(verdict.rows)
        if verdict.factor is not None:
            r.set_factor(verdict.factor)
        if verdict.turn is not None:
            r.admit(verdict.turn)
        self._unqueue(r)
        bisect.insort(self.running, r, key=_order)
        r.start(verdict.swapped)
        return 0

    def _pushed(self, pushed: list[PushDown]) -> int:
        """Apply layer offload's push-downs to their requests. Returns the device blocks they freed."""
        for p in pushed:
            p.request.pushed(p.needs, p.factor)
        return sum(p.freed for p in pushed)

    def _suspend(self, r: Request) -> int:
        """Move a running request's KV down (for now: evict it) and requeue it. Returns blocks freed."""
        freed = self.store.evict(r.session_id)
        self.epoch += 1                # moving it down may have dropped idle sessions' host chunks
        self.running.remove(r)
        r.suspend(self.store.turn_needs(r.session_id))
        r.mark_short(self._is_short(r))
        self._queue(r)
        return freed

    # ---- after the forward ----------------------------------------------------------------------

    def complete(self, items: Iterable[WorkItem], sampled: Iterable[int], eos: frozenset[int],
                 committed: Committed | None = None) -> None:
        """Account the rows of a committed step; `sampled` has one token per item with needs_logits;
        `committed`: what the store's commit answered (the room, each stepped session's turn; None:
        the store did not change, so the requests' `needs` stand and the room is asked again)."""
        now, sampled = time.monotonic(), iter(sampled)
        self.room = committed.room if committed is not None else None
        turns = committed.turns if committed is not None else {}
        for item in items:
            r = item.request
            r.advance(item, turns.get(r.session_id))
            if not item.needs_logits:
                continue
            t = next(sampled)
            if r.warmup:               # the history's KV is up: its sampled token is not part of the session
                self.room = self.finish(r, RequestStatus.FINISHED, "warmup") or self.room
                continue
            r.emit(t, now)
            p = r.sampling
            stop_string = r.text.update(r.output_ids) if r.text is not None else False
            if (t in eos and not p.ignore_eos) or t in p.stop_token_ids or stop_string:
                self.room = self.finish(r, RequestStatus.FINISHED, "stop") or self.room
            elif len(r.output_ids) >= p.max_new_tokens or r.length >= self.max_positions:
                self.room = self.finish(r, RequestStatus.FINISHED, "length") or self.room

    def fail(self, requests: Iterable[Request], error: BaseException) -> None:
        for r in list(requests):
            self.finish(r, RequestStatus.FAILED, "error", error)
        self.room = None


def _order(r: Request) -> tuple[bool, float, int]:
    return r.warmup, r.arrival, r.request_id         # warm-ups last: in the budget, first to be suspended


def _admit_order(r: Request) -> tuple[bool, bool, float, int]:
    return r.warmup, not r.short, r.arrival, r.request_id
