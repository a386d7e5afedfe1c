"""`Admission`: a queued request (WAITING or SUSPENDED) becomes a running one if its first work item
fits the step's token budget and the device blocks left; a part the `Scheduler` composes.

Collaborators, passed in: the store (KV state), the layer-wise part (`LayerwiseScheduling`, or None),
the scheduler's `running` list (read only: who claims device slots, whether the pool serves anyone
else) and `fail(r, error) -> device blocks that made available` (the scheduler's). It mutates only
the request it admits (`pending`, `missing`, `factor`, `lease`, `truncated`, `reused`, `swapped`) and
that session's turn in the store (`lease`, `adopt_prefix`, `begin_turn`); moving the request between
the queues is the scheduler's.

Block rule: the item's blocks plus the device blocks the session already holds for its kept history
must fit in `avail`, and in `avail - reserve` unless it is the only work of an otherwise empty step
(then a request that can never fit fails instead of waiting forever).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..cache import CapacityError, ChunkState, KVStore, SessionBusyError
from .layer_offload import LayerwiseScheduling
from .refusal import no_device_room, no_layered_fit
from .request import Request, RequestStatus
from .work_item import WorkItem, blocks_needed, next_item

RESIDENT = (ChunkState.DEVICE, ChunkState.LAYERED)     # chunks a step reads in place


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `Admission.admit` decided. `item` set: admitted, taking `blocks` device blocks. `item` None:
    `skip` (its session is busy, or it failed: later requests may pass) or wait (head of line: strict FCFS).
    `released`: device blocks a failure made available (an idle session's now)."""

    item: WorkItem | None = None
    blocks: int = 0
    skip: bool = False
    released: int = 0


class Admission:
    def __init__(self, store: KVStore, layered: LayerwiseScheduling | None, running: list[Request],
                 fail: Callable[[Request, CapacityError], int]):
        self.store, self.layered, self.running, self._fail = store, layered, running, fail

    def admit(self, r: Request, budget: int, avail: int, reserve: int, first: bool, committed: int = 0,
              host_avail: int = 0) -> Verdict:
        """Admit `r` if its first work item fits (`first`: nothing else is in this step yet). With
        layer-wise allocation the whole prompt is weighed against the blocks not `committed` to running
        prefills: all layers if it fits, else the most layers that fit (x >= x_min), else it waits.
        On admission `r` holds its session's lease and its turn has begun (history cut to `keep`)."""
        store, alone = self.store, first and not self.running
        if r.status is RequestStatus.WAITING:
            s = store.open(r.session_id)
            if s.busy:
                return Verdict(skip=True)
            try:                       # shared chunks of the prompt's prefix join the session (prefix/sharing.py)
                store.adopt_prefix(r.session_id, r.prompt, r.cache_salt)
            except ValueError as e:    # a cache_salt other than the session's
                return Verdict(skip=True, released=self._fail(r, e))
            keep = min(store.match_prefix(r.session_id, r.prompt), len(r.prompt) - 1)
            r.pending = r.prompt[keep:]
            r.missing = store.missing_positions(r.session_id, cut=keep)     # as after the truncation below
            held = self._held(r, keep)
        else:                          # SUSPENDED: lease held, KV evicted
            keep, held = store.session(r.session_id).num_tokens, 0
            r.missing = store.missing_positions(r.session_id)
        item = next_item(r, budget, keep, store)
        if item is None:
            return Verdict()
        if self.layered is not None:
            factor = self.layered.layer_factor(r, keep, held, avail - committed - (0 if alone else reserve),
                                               host_avail)
            if factor is None:
                if alone:
                    return Verdict(skip=True, released=self._fail(r, no_layered_fit(r, host_avail)))
                return Verdict()
            r.factor = factor
            item = replace(item, factor=factor)
            if r.status is RequestStatus.WAITING:      # layer_factor may have moved its device chunks down
                held = self._held(r, keep)
        need = blocks_needed(store, item, keep)
        slots = store.available_slots()                    # virtual layout: a session needs a device slot
        if slots is not None:
            claimed = sum(1 for q in self.running if store.device_pool.slot_of(q.session_id) is None)
            if slots - claimed < 1:                        # running sessions not yet placed claim them first
                return Verdict()
        if need + held > avail or (need + held > avail - reserve and not alone):
            if alone and need + held > avail:
                return Verdict(skip=True, released=self._fail(r, no_device_room(
                    r, need + held, avail, store.block_size, self.layered is not None, more=False)))
            return Verdict()
        if r.status is RequestStatus.WAITING:
            try:
                lease = store.lease(r.session_id)
                lease.__enter__()
            except SessionBusyError:
                return Verdict(skip=True)
            r.lease = lease
            turn = store.begin_turn(r.session_id, r.prompt, r.cache_salt)      # cuts the history to `keep`
            r.truncated, r.reused = turn.truncated_tokens, turn.reused_tokens
        r.swapped += self._below_device(r.session_id, keep)
        return Verdict(item, need + held)

    def _held(self, r: Request, keep: int) -> int:
        """Device blocks the session holds for its first `keep` tokens."""
        s = self.store.session(r.session_id)
        return sum(1 for c in s.chunks[: -(-keep // self.store.block_size)] if c.state is ChunkState.DEVICE)

    def _below_device(self, session_id: str, length: int) -> int:
        """History tokens < length whose KV is stored in a lower tier (host, disk, hidden states) and
        not cached on the device: `plan_step` brings them up (swap-in or rebuild), not a recompute."""
        bs, n = self.store.block_size, 0
        for k, c in enumerate(self.store.session(session_id).chunks[: -(-length // bs)]):
            if c.state not in (*RESIDENT, ChunkState.DROPPED) and getattr(c, "shadow", None) is None:
                n += min((k + 1) * bs, length) - k * bs
        return n
