"""`Admission`: a queued request (WAITING or SUSPENDED) becomes a running one if its first work item
fits the step's token budget and the device blocks left; a part the `Scheduler` composes.

Collaborators, passed in: the store, the layer-wise part (`LayerwiseScheduling`, or None), the
scheduler's `running` list (read only: who claims device slots, whether the pool serves anyone
else) and `fail(r, error) -> device blocks that made available` (the scheduler's). A WAITING request
takes two store calls: `turn_needs` (what admitting it would take: unless asked in this pass already)
and `begin` (lease and turn at once). It mutates only the request it admits (`pending`, `missing`,
`missing_ids`, `needs`, `factor`, `leased`, `truncated`, `reused`, `swapped`); moving the request
between the queues is the scheduler's.

Block rule: the item's blocks plus the device blocks the session already holds for its kept history
must fit in `avail`, and in `avail - reserve` unless it is the only work of an otherwise empty step
(then a request that can never fit fails instead of waiting forever).

Refusal at submit: a request that can never fit is failed before it takes anything; the
CapacityErrors the scheduler fails a request with when the pools are taken by others.

"Never fits" is decided from the pool sizes alone (not from what other sessions hold now, which
changes), for the request's least footprint:
    tokens = len(prompt) + min(max_new_tokens - 1, block_size)   (the prompt and one block of decode)
    chunks = ceil(tokens / block_size)
Without layer-wise allocation every chunk needs a device block with all layers: refused iff
chunks > device blocks. With it (LayerKV) the chunks the turn adds (`new`, past the history it
shares with the session) may keep only some layers on the device, every layer they do not keep in a
host slot; history on the host is read in place. Refused iff even the sparsest keep factor allowed
by x_min does not fit:
    new > host blocks, or residue_blocks(f_max, new) > device blocks, or
    chunks > host blocks + device blocks - residue_blocks(f_max, new)
(f_max: the keep factor with the fewest layers on the device and >= x_min of them; 0 when x_min = 0.)
Everything that passes may still wait for room; it is served once the pool is free enough.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..cache.doors.engine import CapacityError, EngineStore, SessionBusyError, StoreError
from ..kernels.blocks import blocks_for
from .layer_offload import LayerwisePolicy, LayerwiseScheduling, residue_blocks
from .request import Request, RequestStatus, WorkItem, blocks_needed, next_item


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `Admission.admit` decided. `item` set: admitted, taking `blocks` device blocks. `item` None:
    `skip` (its session is busy, or it failed: later requests may pass) or wait (head of line: strict FCFS).
    `released`: device blocks a failure made available (an idle session's now). `swapped`: kept tokens the
    admitted request's steps bring up from below the device (the scheduler starts it with them)."""

    item: WorkItem | None = None
    blocks: int = 0
    skip: bool = False
    released: int = 0
    swapped: int = 0


class Admission:
    def __init__(self, store: EngineStore, layered: LayerwiseScheduling | None, running: list[Request],
                 fail: Callable[[Request, Exception], int]):
        self.store, self.layered, self.running, self._fail = store, layered, running, fail

    def ask(self, r: Request, pass_: tuple[int, int]) -> ValueError | None:
        """Ask the store what admitting the WAITING `r` would take (`r.needs`). A cache_salt other than
        the session's leaves `r.needs` None and is returned (admission fails `r` with it)."""
        try:
            r.asked(self.store.turn_needs(r.session_id, r.prompt, r.cache_salt), pass_)
        except ValueError as e:
            r.asked(None, pass_)
            return e
        return None

    def admit(self, r: Request, budget: int, avail: int, reserve: int, first: bool, pass_: tuple[int, int],
              slots: int | None, committed: int = 0, host_avail: int = 0) -> Verdict:
        """Admit `r` if its first work item fits (`first`: nothing else is in this step yet; `slots`:
        virtual layout, device slots left in this pass). With layer-wise allocation the whole prompt
        is weighed against the blocks not `committed` to running prefills: all layers if it fits, else
        the most layers that fit (x >= x_min), else it waits. On admission `r` holds its session's
        lease and its turn has begun (history cut to `keep`)."""
        store, alone, bs = self.store, first and not self.running, self.store.block_size
        if r.status is RequestStatus.WAITING:
            refused = self.ask(r, pass_) if r.needs_pass != pass_ or r.needs is None else None
            if refused is not None:
                return Verdict(skip=True, released=self._fail(r, refused))
            needs = r.needs
            assert needs is not None       # asked above, or at an earlier pass of this one
            if needs.busy:
                return Verdict(skip=True)
            keep, held = needs.keep, needs.held
            r.prepare(needs)
        else:                          # SUSPENDED: lease held, KV evicted (`needs` asked at the suspension)
            assert r.needs is not None
            keep, held = r.needs.keep, 0
        item = next_item(r, budget, keep, bs)
        if item is None:
            return Verdict()
        if self.layered is not None:
            factor = self.layered.layer_factor(r, keep, held, avail - committed - (0 if alone else reserve),
                                               host_avail)
            if factor is None:
                if alone:
                    return Verdict(skip=True, released=self._fail(r, no_layered_fit(r, host_avail)))
                return Verdict()
            r.set_factor(factor)
            item = replace(item, factor=factor)
            if r.status is RequestStatus.WAITING and r.needs is not None:   # layer_factor may have moved chunks down
                held = r.needs.held
        need = blocks_needed(item)
        if slots is not None:          # virtual layout: running sessions not yet placed claim slots first
            claimed = sum(1 for q in self.running if q.needs is not None and not q.needs.has_slot)
            if slots - claimed < 1:
                return Verdict()
        if need + held > avail or (need + held > avail - reserve and not alone):
            if alone and need + held > avail:
                return Verdict(skip=True, released=self._fail(r, no_device_room(
                    r, need + held, avail, bs, self.layered is not None, more=False)))
            return Verdict()
        if r.status is RequestStatus.WAITING:
            try:
                turn = store.begin(r.session_id, r.prompt, r.cache_salt, keep=keep)   # cuts the history to `keep`
            except SessionBusyError:
                return Verdict(skip=True)
            except StoreError:         # the session changed since `turn_needs` (another caller): ask again
                r.asked(r.needs, None)
                return Verdict(skip=True)
            r.admit(turn.truncated_tokens, turn.reused_tokens)
            # a cut shared chunk copied on write keeps its KV: fewer rows to recompute than the item that fitted
            if r.missing and self.layered is None and r.keep_missing(set(store.missing_positions(r.session_id))):
                again = next_item(r, budget, keep, bs)
                assert again is not None
                item, need = again, blocks_needed(again)
        assert r.needs is not None
        return Verdict(item, need + held, swapped=r.needs.stored_below())


def least_chunks(r: Request, block_size: int) -> int:
    """Chunks the request needs at the least: its prompt and up to one block of decode."""
    tokens = len(r.prompt) + min(r.sampling.max_new_tokens - 1, block_size)
    return blocks_for(tokens, block_size)


def refusal(store: EngineStore, layerwise: LayerwisePolicy | None, r: Request) -> CapacityError | None:
    """The CapacityError to fail `r` with at submit, or None if some state of the pools serves it."""
    sizes = store.pool_sizes
    bs, device = store.block_size, sizes.device_blocks
    chunks = least_chunks(r, bs)
    if chunks <= device:
        return None
    what = (f"request {r.request_id} (session {r.session_id!r}) can never fit: its {len(r.prompt)} prompt tokens "
            f"and one block of decode need {chunks} chunks of {bs} tokens")
    if layerwise is None:
        return CapacityError(
            f"{what} with all layers on the device, and the device pool holds {device} ({device * bs} tokens). "
            f"Raise device_capacity, or serve it with layerwise_kv=True (layer-wise KV: the layers that do not "
            f"fit live on the host tier; host_capacity of at least {chunks * bs} tokens)")
    host = sizes.host_blocks
    keep = 0
    if r.session_id in store:            # the history the turn shares: already on some tier
        keep = min(store.match_prefix(r.session_id, r.prompt), len(r.prompt) - 1)
    new = chunks - blocks_for(keep, bs)
    x_min = layerwise.x_min(len(r.prompt) - keep, keep)
    sparsest = layerwise.factors(x_min)[-1]
    on_device = residue_blocks(sparsest, new)
    if new <= host and on_device <= device and chunks <= host + device - on_device:
        return None
    kept = layerwise.num_layers if sparsest == 1 else (0 if sparsest == 0 else layerwise.num_layers // sparsest)
    return CapacityError(
        f"{what}, {new} of them new, even with layer-wise KV: keeping {kept} of {layerwise.num_layers} layers on "
        f"the device (x_min = {x_min}) takes {on_device} of the {device} device blocks, and the rest needs host "
        f"slots ({host} in the host pool). Raise device_capacity or host_capacity")


# ---- failures while scheduling (the pools are taken by others and nothing more can be freed) ----

def no_device_room(r: Request, need: int, avail: int, block_size: int, layerwise: bool, more: bool) -> CapacityError:
    """`r` needs `need` (`more`: further) device blocks and only `avail` can be made available."""
    hint = "" if layerwise else (
        ", or serve it with layerwise_kv=True (layers that do not fit on the device live on the host tier)")
    return CapacityError(f"request {r.request_id} (session {r.session_id!r}) needs {need} {'more ' if more else ''}"
                         f"device blocks of {block_size} tokens and only {avail} can be made available; raise "
                         "device_capacity" + hint)


def no_host_slots(r: Request) -> CapacityError:
    return CapacityError(
        f"request {r.request_id} (session {r.session_id!r}) needs host slots for its layer-wise KV and the "
        "host tier has none left for it (the other running requests hold them); raise host_capacity")


def no_layered_fit(r: Request, host_avail: int) -> CapacityError:
    return CapacityError(
        f"request {r.request_id} (session {r.session_id!r}) does not fit even with layer-wise KV allocation: its "
        f"prompt needs more host slots ({host_avail} available) or more device blocks for its x_min kept layers "
        "than can be made available; raise host_capacity or device_capacity")
