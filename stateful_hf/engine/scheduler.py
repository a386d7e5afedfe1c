"""The scheduler: the one owner of request state. Iteration-level, FCFS, a per-step token budget.

Every step it (1) continues running requests oldest first (a decode token each, then chunks of
their prefills and recomputations), suspending the latest-arrived ones when their session blocks
do not fit; (2) admits queued requests in arrival order while more than a reserve of device blocks
stays available and, with an SLO policy, while the queued prefills' predicted time fits in the
running decodes' smallest TPOT slack (`slo.py`). With layer-wise allocation (`layered_chunks.py`) a
prefill that does not fit with all layers is admitted keeping fewer layers on the device, and a
running request short of blocks has its layers pushed down to the host before anyone is suspended.
The store owns KV state; the scheduler only reads it and asks for steps/evictions/push-downs.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..cache import CapacityError, ChunkState, KVStore, SessionBusyError
from .admission import no_device_room, no_host_slots, no_layered_fit
from .layer_offload import LayerwisePolicy, LayerwiseScheduling
from .request import Request, RequestStatus
from .slo import SloPolicy, prefill_rows
from .work_item import WorkItem, next_item, whole_item

_RESIDENT = (ChunkState.DEVICE, ChunkState.LAYERED)     # chunks a step reads in place


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_tokens: int = 512        # rows per forward (prompt chunks + recomputed + decode tokens)
    max_num_seqs: int = 128            # running requests at most
    reserve_fraction: float = 0.1      # admit only while more than this share of device blocks is available

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")


class Scheduler:
    def __init__(self, store: KVStore, config: SchedulerConfig, max_positions: int,
                 slo: SloPolicy | None = None, layerwise: LayerwisePolicy | None = None):
        if config.max_batch_tokens < store.block_size:
            raise ValueError(f"max_batch_tokens ({config.max_batch_tokens}) must be >= the store's chunk size "
                             f"({store.block_size}): recomputation goes by whole chunks")
        self.store, self.config, self.max_positions, self.slo = store, config, max_positions, slo
        self.layerwise = layerwise
        self.waiting: list[Request] = []    # WAITING and SUSPENDED, by arrival
        self.running: list[Request] = []    # RUNNING, by arrival
        self.finished: list[Request] = []   # ended since the engine last drained them
        # the layer-wise part (layer_offload.py); it reads `running`, which is never rebound
        self.layered = LayerwiseScheduling(store, layerwise, config, slo, self.running, self._needs) \
            if layerwise is not None else None
        self._released = 0                  # device blocks the last _admit's failure made available

    # ---- queue ----------------------------------------------------------------------------------

    def add(self, r: Request) -> None:
        bisect.insort(self.waiting, r, key=_order)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def finish(self, r: Request, status: RequestStatus, reason: str, error: BaseException | None = None) -> None:
        """End a request in any state: release its lease, leave the queues."""
        if r.status.done:
            return
        if r.lease is not None:
            self.store.add_generated(r.session_id, len(r.output_ids))    # the rest of last_turn: the store's
            r.lease.__exit__(None, None, None)
            r.lease = None
        for q in (self.waiting, self.running):
            if r in q:
                q.remove(r)
        r.status, r.finish_reason, r.error, r.finished_at = status, reason, error, time.monotonic()
        self.finished.append(r)

    def _fail(self, r: Request, error: CapacityError) -> int:
        """Fail `r` and release what it held; returns the device blocks that made available (its
        session's blocks become an idle session's, which a later admission in this pass may take)."""
        before = self.store.available_blocks()
        self.finish(r, RequestStatus.FAILED, "error", error)
        return max(self.store.available_blocks() - before, 0)

    def reap_cancelled(self) -> None:
        for r in [r for r in self.running + self.waiting if r.cancel_requested]:
            self.finish(r, RequestStatus.CANCELLED, "cancelled")

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> list[WorkItem]:
        self.reap_cancelled()
        budget = self.config.max_batch_tokens
        reserve = math.ceil(self.config.reserve_fraction * self.store.device_pool.num_blocks)
        if self.layerwise is not None:
            self.layered.project(self.store.available_blocks(), reserve)
        avail = self.store.available_blocks()
        host_taken = 0                 # host slots this pass's items fill (push-downs take theirs at once)
        items: list[WorkItem] = []
        starved: list[Request] = []    # running layer-wise requests the host tier had no slot for
        # (1) running requests, oldest first; decode tokens are counted out of the budget first.
        prefill_budget = budget - sum(r.decoding for r in self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            tokens = 1 if r.decoding else min(prefill_budget, budget)
            item = self._item(r, tokens, self._length(r)) if tokens > 0 else None
            if item is None:
                i += 1
                continue
            need = self._blocks_needed(r, item)
            if need > avail and self.layerwise is not None:   # push layers down before suspending anyone
                for q in reversed(self.running[i + 1:]):
                    if need <= avail:
                        break
                    avail += self.layered.push_down(q, full=True)
                if need > avail and r.factor != 0:
                    avail += self.layered.push_down(r, full=True)
                    item = replace(item, factor=0)
                    need = self._blocks_needed(r, item)
            while need > avail and self.running[-1] is not r:
                avail += self._suspend(self.running[-1])
            if need > avail:
                if i == 0:             # what it held counts for the requests after it in this pass
                    avail += self._fail(r, no_device_room(r, need, avail, self.store.block_size,
                                                          self.layerwise is not None, more=True))
                else:
                    avail += self._suspend(r)
                continue
            if item.factor != 1 and self._host_needed(r, item) > self._host_left(host_taken):
                item = self.layered.trim_to_host(r, item, self._host_left(host_taken))
                if item is None:       # waits for host slots; its device blocks stay unspent
                    starved.append(r)
                    i += 1
                    continue
                need = self._blocks_needed(r, item)
            avail -= need
            host_taken += self._host_needed(r, item)
            budget -= item.num_tokens
            if not r.decoding:
                prefill_budget -= item.num_tokens
            items.append(item)
            i += 1
        if starved and not items:      # no one can move: the oldest starved request fails alone
            r = starved[0]
            avail += self._fail(r, no_host_slots(r))
        # (2) admission, FCFS, while more than the reserve stays available and (SLO policy) the
        # admitted prefills' predicted seconds fit in min_i slack_i of the running decodes.
        committed = self.layered.committed(items) if self.layerwise is not None else 0
        host_committed = self.layered.host_committed(items) if self.layerwise is not None else 0
        allowance = self.slo.allowance(self.running) if self.slo is not None else math.inf
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cost = self.slo.prefill_seconds(prefill_rows(self.store, r)) if allowance < math.inf else 0.0
            if cost > allowance:       # would push a decode past its TPOT SLO: defer, FCFS
                self.slo.deferred += 1
                break
            self._released = 0
            admitted = self._admit(r, budget, avail, reserve, first=not items, committed=committed,
                                   host_avail=self._host_left(host_taken) - host_committed)
            avail += self._released    # blocks a request failed in _admit gave back
            if admitted is None:       # head of line does not fit: strict FCFS, stop here
                break
            if admitted is False:      # its session is busy with an earlier turn: let later sessions pass
                continue
            item, blocks = admitted
            avail -= blocks
            host_taken += self._host_needed(r, item)
            if self.layerwise is not None:
                committed += self.layered.future_blocks(r, item)
                host_committed += self.layered.future_host(r, item)
            allowance -= cost
            budget -= item.num_tokens
            items.append(item)
        return items

    def _admit(self, r: Request, budget: int, avail: int, reserve: int, first: bool, committed: int = 0,
               host_avail: int = 0):
        """Admit `r` if its first work item fits. Returns (item, blocks it takes from `avail`), None
        if it does not fit (and must wait), or False if its session is busy. With layer-wise allocation
        the whole prompt is weighed against the blocks not `committed` to running prefills: all layers
        if it fits, else the most layers that fit (x >= x_min), else it waits."""
        store = self.store
        if r.status is RequestStatus.WAITING:
            s = store.open(r.session_id)
            if s.busy:
                return False
            try:                       # shared chunks of the prompt's prefix join the session (prefix_sharing.py)
                store.adopt_prefix(r.session_id, r.prompt, r.cache_salt)
            except ValueError as e:    # a cache_salt other than the session's
                self._released += self._fail(r, e)
                return False
            keep = min(store.match_prefix(r.session_id, r.prompt), len(r.prompt) - 1)
            r.pending = r.prompt[keep:]
            r.missing = store.missing_positions(r.session_id, cut=keep)     # as after the truncation below
            held = sum(1 for c in s.chunks[: -(-keep // store.block_size)] if c.state is ChunkState.DEVICE)
        else:                          # SUSPENDED: lease held, KV evicted
            keep, held = self._length(r), 0
            r.missing = store.missing_positions(r.session_id)
        item = self._item(r, budget, keep)
        if item is None:
            return None
        if self.layerwise is not None:
            factor = self.layered.layer_factor(r, keep, held, avail - committed - (0 if first and not self.running
                                                                            else reserve), host_avail)
            if factor is None:
                if first and not self.running:
                    self._released += self._fail(r, no_layered_fit(r, host_avail))
                    return False
                return None
            r.factor = factor
            item = replace(item, factor=factor)
            if r.status is RequestStatus.WAITING:      # _layer_factor may have moved its device chunks down
                s = store.session(r.session_id)
                held = sum(1 for c in s.chunks[: -(-keep // store.block_size)] if c.state is ChunkState.DEVICE)
        need = self._blocks_needed(r, item, keep)
        slots = store.available_slots()                    # virtual layout: a session needs a device slot
        if slots is not None:
            claimed = sum(1 for q in self.running if store.device_pool.slot_of(q.session_id) is None)
            if slots - claimed < 1:                        # running sessions not yet placed claim them first
                return None
        if need + held > avail or (need + held > avail - reserve and not (first and not self.running)):
            if first and not self.running and need + held > avail:
                self._released += self._fail(r, no_device_room(r, need + held, avail, store.block_size,
                                                               self.layerwise is not None, more=False))
                return False
            return None
        if r.status is RequestStatus.WAITING:
            try:
                lease = store.lease(r.session_id)
                lease.__enter__()
            except SessionBusyError:
                return False
            r.lease = lease
            turn = store.begin_turn(r.session_id, r.prompt, r.cache_salt)      # cuts the history to `keep`
            r.truncated, r.reused = turn.truncated_tokens, turn.reused_tokens
        r.swapped += self._below_device(r.session_id, keep)
        self.waiting.remove(r)
        bisect.insort(self.running, r, key=_order)
        r.status = RequestStatus.RUNNING
        return item, need + held

    def _suspend(self, r: Request) -> int:
        """Move a running request's KV down (for now: evict it) and requeue it. Returns blocks freed."""
        freed = self.store.evict(r.session_id)
        self.running.remove(r)
        r.status = RequestStatus.SUSPENDED
        r.suspensions += 1
        r.missing = self.store.missing_positions(r.session_id)
        bisect.insort(self.waiting, r, key=_order)
        return freed

    def _item(self, r: Request, budget: int, length: int) -> WorkItem | None:
        return next_item(r, budget, length, self.store)

    def _blocks_needed(self, r: Request, item: WorkItem, length: int | None = None) -> int:
        """Device blocks the store must give this item: chunks up to its last row that are not on the
        device (chunks past the history `length` are new or will be cut, so they count). A layer-wise
        item (factor != 1) fills its chunks with residue blocks, ceil(n / f) blocks at most, and reads
        host chunks in place."""
        return self.store.blocks_needed(r.session_id, self._end(item), length=self._length(r) if length is None
                                        else length, factor=item.factor)

    def _whole_item(self, r: Request, keep: int) -> WorkItem:
        return whole_item(r, keep)

    def _host_left(self, taken: int) -> int:
        return self.layered.host_left(taken) if self.layered is not None else 0

    def _host_needed(self, r: Request, item: WorkItem) -> int:
        return self.layered.host_needed(r, item) if self.layered is not None else 0

    def _needs(self, r: Request, item: WorkItem, length: int | None = None):
        """The store's ChunkNeeds of the item: (chunks it fills, copies up, reads in place)."""
        return self.store.chunk_needs(r.session_id, self._end(item), length=self._length(r) if length is None
                                      else length, factor=item.factor)

    @staticmethod
    def _end(item: WorkItem) -> int:
        """One past the item's last row position."""
        return max(item.start + len(item.new_ids), max(item.recompute, default=-1) + 1)

    def _below_device(self, session_id: str, length: int) -> int:
        """History tokens < length whose KV is stored in a lower tier (host, disk, hidden states) and
        not cached on the device: `plan_step` brings them up (swap-in or rebuild), not a recompute."""
        bs, n = self.store.block_size, 0
        for k, c in enumerate(self.store.session(session_id).chunks[: -(-length // bs)]):
            if c.state not in (*_RESIDENT, ChunkState.DROPPED) and getattr(c, "shadow", None) is None:
                n += min((k + 1) * bs, length) - k * bs
        return n

    def _length(self, r: Request) -> int:
        return self.store.session(r.session_id).num_tokens

    # ---- after the forward ----------------------------------------------------------------------

    def complete(self, items: Iterable[WorkItem], sampled: Iterable[int], eos: frozenset[int]) -> None:
        """Account the rows of a committed step; `sampled` has one token per item with needs_logits."""
        now, sampled = time.monotonic(), iter(sampled)
        for item in items:
            r = item.request
            r.missing = r.missing[len(item.recompute):]
            r.recomputed += len(item.recompute)
            r.pending = r.pending[len(item.new_ids):]
            r.computed += item.num_tokens
            if not item.needs_logits:
                continue
            t = next(sampled)
            r.output_ids.append(t)
            r.first_token_at = r.first_token_at or now
            p = r.sampling
            stop_string = r.text.update(r.output_ids) if r.text is not None else False
            if (t in eos and not p.ignore_eos) or t in p.stop_token_ids or stop_string:
                self.finish(r, RequestStatus.FINISHED, "stop")
            elif len(r.output_ids) >= p.max_new_tokens or self._length(r) >= self.max_positions:
                self.finish(r, RequestStatus.FINISHED, "length")
            else:
                r.pending = [t]

    def fail(self, requests: Iterable[Request], error: BaseException) -> None:
        for r in list(requests):
            self.finish(r, RequestStatus.FAILED, "error", error)


def _order(r: Request) -> tuple[float, int]:
    return r.arrival, r.request_id

