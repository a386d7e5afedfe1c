"""`Admission`: a queued request (WAITING or SUSPENDED) becomes a running one if its first work item
fits the step's token budget and the device blocks left; a part the `Scheduler` composes.

Collaborators, passed in: the store, the layer-wise part (`LayerScheduling`: `AllLayers` or LayerKV's) and the
scheduler's `running` list (read only: who claims device slots, whether the pool serves anyone
else). A WAITING request takes two store calls: `turn_needs` (what admitting it would take: unless
asked in this pass already) and `begin` (lease and turn at once). It changes no request: it returns
a `Verdict` holding what it decided and the store's answers (the `Answer` asked, the rows, the keep
factor, the turn begun), which the scheduler, the one writer, applies through the request's methods
(failing it, or starting it and moving it between the queues).

`AdmissionPolicy`: the scheduler's hook before a request's blocks are weighed (`Gate`): warm-ups
yield to queued turns and are superseded by their session's turns; with an SLO policy, a prefill that
would push a running decode past its TPOT SLO is deferred.

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

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..cache.doors.engine import CapacityError, EngineStore, SessionBusyError, StoreError, TurnNeeds, TurnStats
from ..kernels.blocks import blocks_for
from .layer_offload import LayerScheduling
from .request import Request, RequestStatus, Rows, WorkItem, item_end, next_item
from .slo import SloPolicy


@dataclass(frozen=True, slots=True)
class Answer:
    """The store's answer about admitting a queued request (`turn_needs`), asked in scheduler pass `pass_`, for
    the scheduler to record (`Request.asked`). `needs` None: refused (`error`, a cache_salt other than the
    session's). `pass_` None: the session changed since: ask again."""

    needs: TurnNeeds | None
    pass_: tuple[int, int] | None
    error: ValueError | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `Admission.admit` decided and the store's answers it got, for the scheduler to apply to the request.
    `item` set: admitted, taking `blocks` device blocks; it feeds `rows` (None: its own, a SUSPENDED one's) at
    keep factor `factor` (None: its own), its turn began (`turn`, the store's `begin`: None for a SUSPENDED
    one, whose lease it kept) and its steps bring `swapped` kept tokens up from below the device. `item` None:
    `error` (fail it), `skip` (its session is busy or it failed: later requests may pass) or wait (head of
    line: strict FCFS). Whatever it decided, `answer` (None: none new) is the store's latest about it."""

    item: WorkItem | None = None
    blocks: int = 0
    skip: bool = False
    error: Exception | None = None
    answer: Answer | None = None
    rows: Rows | None = None
    factor: int | None = None
    turn: TurnStats | None = None
    swapped: int = 0


class Admission:
    def __init__(self, store: EngineStore, layers: LayerScheduling, running: list[Request]):
        self.store, self.layers, self.running = store, layers, running

    def ask(self, r: Request, pass_: tuple[int, int]) -> Answer:
        """Ask the store what admitting the WAITING `r` would take. A cache_salt other than the session's
        is refused: the answer's `error` (admission fails `r` with it)."""
        try:
            return Answer(self.store.turn_needs(r.session_id, r.prompt, r.cache_salt), pass_)
        except ValueError as e:
            return Answer(None, pass_, e)

    def admit(self, r: Request, budget: int, avail: int, reserve: int, first: bool, pass_: tuple[int, int],
              slots: int | None, committed: int = 0, host_avail: int = 0) -> Verdict:
        """Whether `r` is admitted: if its first work item fits (`first`: nothing else is in this step yet;
        `slots`: virtual layout, device slots left in this pass). With layer-wise allocation the whole
        prompt is weighed against the blocks not `committed` to running prefills: all layers if it fits,
        else the most layers that fit (x >= x_min), else it waits. An admitted WAITING `r`'s turn has begun
        in the store (its session's lease taken, history cut to `keep`): the verdict's `turn`. Changes no
        request."""
        store, alone, bs = self.store, first and not self.running, self.store.block_size
        answer: Answer | None = None
        rows: Rows | None = None
        if r.status is RequestStatus.WAITING:
            needs = r.needs
            if r.needs_pass != pass_ or needs is None:
                answer = self.ask(r, pass_)
                if answer.error is not None:
                    return Verdict(skip=True, error=answer.error, answer=answer)
                needs = answer.needs
            assert needs is not None       # asked above, or at an earlier pass of this one
            if needs.busy:
                return Verdict(skip=True, answer=answer)
            keep, held = needs.keep, needs.held
            rows = Rows.answered(r.prompt, needs)
        else:                          # SUSPENDED: lease held, KV evicted (`needs` asked at the suspension)
            assert r.needs is not None
            needs, keep, held = r.needs, r.needs.keep, 0
        item = next_item(r, budget, keep, bs, rows)
        if item is None:
            return Verdict(answer=answer)
        fit = self.layers.layer_factor(r, needs, rows or r.rows(), keep, held,
                                       avail - committed - (0 if alone else reserve), host_avail)
        if fit.needs is not None:      # it moved the session's own device chunks to the host
            needs, answer = fit.needs, Answer(fit.needs, pass_)
            held = needs.held
        if fit.factor is None:
            if alone:
                return Verdict(skip=True, error=no_layered_fit(r, host_avail), answer=answer)
            return Verdict(answer=answer)
        factor = fit.factor
        if factor != item.factor:
            item = replace(item, factor=factor)
        need = needs.blocks(item_end(item), item.factor)
        if slots is not None:          # virtual layout: running sessions not yet placed claim slots first
            claimed = sum(1 for q in self.running if q.needs is not None and not q.needs.has_slot)
            if slots - claimed < 1:
                return Verdict(answer=answer)
        if need + held > avail or (need + held > avail - reserve and not alone):
            if alone and need + held > avail:
                return Verdict(skip=True, answer=answer, error=no_device_room(
                    r, need + held, avail, bs, self.layers.room_hint, more=False))
            return Verdict(answer=answer)
        turn = None
        if rows is not None:           # WAITING
            try:
                turn = store.begin(r.session_id, r.prompt, r.cache_salt, keep=keep)   # cuts the history to `keep`
            except SessionBusyError:
                return Verdict(skip=True, answer=answer)
            except StoreError:         # the session changed since `turn_needs` (another caller): ask again
                return Verdict(skip=True, answer=Answer(needs, None))
            # a cut shared chunk copied on write keeps its KV: fewer rows to recompute than the item that fitted
            if rows.missing and self.layers.recuts:
                still = rows.keeping(set(store.missing_positions(r.session_id)))
                if len(still.missing) < len(rows.missing):
                    rows = still
                    again = next_item(r, budget, keep, bs, rows)
                    assert again is not None
                    item, need = again, needs.blocks(item_end(again), again.factor)
        return Verdict(item, need + held, answer=answer, rows=rows, factor=factor, turn=turn,
                       swapped=needs.stored_below())


class Gate(enum.Enum):
    """What the admission policy says of a queued request, before its blocks are weighed."""

    WEIGH = "weigh"                # `Admission.admit` decides
    SUPERSEDED = "superseded"      # a warm-up whose session has a turn queued or changed: cancel it
    DEFER = "defer"                # its prefill would push a running decode past its TPOT SLO: stop the pass (FCFS)


class AdmissionPolicy:
    """The scheduler's admission hook: warm-ups and the SLO. Collaborators: the store (a warm-up's session
    length) and the SLO policy, or None (its `deferred` counter is written here)."""

    def __init__(self, store: EngineStore, slo: SloPolicy | None):
        self.store, self.slo = store, slo

    def yielding(self, head: Request | None, running: Iterable[Request]) -> list[Request]:
        """The running warm-ups to cancel as a pass begins: all of them when a turn heads the queue (`head`)."""
        return [q for q in running if q.warmup] if head is not None and not head.warmup else []

    def allowance(self, running: list[Request]) -> float:
        """Seconds of prefill this pass may admit: the running decodes' smallest TPOT slack (inf without SLO)."""
        return self.slo.allowance(running) if self.slo is not None else math.inf

    def gate(self, r: Request, turns: int, allowance: float) -> tuple[Gate, float]:
        """The gate for `r` (its session's first queued turn, of `turns` queued), and its prefill's predicted
        seconds (0 unless an SLO allowance holds), with `allowance` seconds left in this pass."""
        if r.warmup and (turns > 1 or self.store.num_tokens(r.session_id) != len(r.prompt)):
            return Gate.SUPERSEDED, 0.0
        cost = self.slo.prefill_seconds(r.prefill_rows()) if self.slo is not None and allowance < math.inf else 0.0
        if cost > allowance and self.slo is not None:
            self.slo.deferred += 1
            return Gate.DEFER, cost
        return Gate.WEIGH, cost


def least_chunks(r: Request, block_size: int) -> int:
    """Chunks the request needs at the least: its prompt and up to one block of decode."""
    tokens = len(r.prompt) + min(r.sampling.max_new_tokens - 1, block_size)
    return blocks_for(tokens, block_size)


def refusal(store: EngineStore, layers: LayerScheduling, r: Request) -> CapacityError | None:
    """The CapacityError to fail `r` with at submit, or None if some state of the pools serves it."""
    bs = store.block_size
    chunks = least_chunks(r, bs)
    if chunks <= store.pool_sizes.device_blocks:
        return None
    what = (f"request {r.request_id} (session {r.session_id!r}) can never fit: its {len(r.prompt)} prompt tokens "
            f"and one block of decode need {chunks} chunks of {bs} tokens")
    return layers.refusal(r, what, chunks)


# ---- failures while scheduling (the pools are taken by others and nothing more can be freed) ----

def no_device_room(r: Request, need: int, avail: int, block_size: int, hint: str, more: bool) -> CapacityError:
    """`r` needs `need` (`more`: further) device blocks and only `avail` can be made available; `hint`, what
    else could serve it (the layer-wise part's `room_hint`)."""
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
