"""The step planner: one forward step over the store (plan, commit, abort) and the one writer of a
session's `last_turn`. What a step does with each chunk is `turn.py`'s classification.

`plan` reserves device blocks (placement moves other sessions' chunks down by the policy), copies
host/disk chunks of the context up (swap-in), queues hidden chunks for a layer-wise rebuild, appends
the new tokens to the history and describes the step; `commit` makes it permanent, `abort` takes it
back. Raising leaves the store unchanged.

Collaborators: the session table, the pools, placement, swap-in, the hidden tier and the layered
chunks (`feature.py`'s null parts when the store lacks them), the registered features (`StoreFeature`:
per-layer work, commit, abort, settle), the transfer engine (end of step), the counters (written:
recomputed, device_hits).
Mutates: the step's sessions' token ids and chunk tables, and `last_turn` (`begin_turn` sets it and
`in_turn`, `commit` adds the computed and recomputed rows of a session in a turn, `add_generated`
the generated tokens).
Ordering: `commit`/`abort` first end the transfer engine's step (emulated copies land), then call the
features in registration order (hidden states: captured rows flushed, rebuilds settled; LayerKV: staged
layers flushed or discarded; the page mapper: blocks to map ahead); only then are slots freed.
Every method runs with the store lock held.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..kernels import KernelState, PagedBatch, StepBackends
from ..kernels.blocks import blocks_for
from ..options import Layout
from .audit.stats import Counters
from .errors import CapacityError, StoreError
from .movement.placement import Placement
from .movement.swap_in import SwapIn
from .movement.transfer import Transfer
from .pools.pool import BlockPool
from .pools.tier_pools import TierPools, count_chunks
from .sessions.session import HIDDEN_FORMS, Chunk, ChunkState, Session, SessionTable, TurnStats
from .step import StepBatch, StepEntry
from .turn import check_factor, entry_needs

if TYPE_CHECKING:
    from .feature import NoHiddenStates, NoLayers, StoreFeature
    from .hidden.states import HiddenRestore
    from .hidden.tier import HiddenTier
    from .layerwise.chunks import LayeredChunks

DEVICE, DROPPED, HOST, LAYERED = ChunkState.DEVICE, ChunkState.DROPPED, ChunkState.HOST, ChunkState.LAYERED
DISK = ChunkState.DISK


class StepPlanner:
    def __init__(self, sessions: SessionTable, tiers: TierPools, placement: Placement, swap_in: SwapIn,
                 hidden: HiddenTier | NoHiddenStates, layered: LayeredChunks | NoLayers, transfer: Transfer,
                 counters: Counters, kernels: KernelState, *, layout: Layout, backends: StepBackends):
        self.sessions, self.tiers, self.placement, self.swap_in = sessions, tiers, placement, swap_in
        self.hidden, self.layered, self.transfer, self.counters = hidden, layered, transfer, counters
        self.kernels, self.layout, self.backends = kernels, layout, backends
        self.features: tuple[StoreFeature, ...] = ()      # registered by `store_parts.assemble`
        self.layer_features: tuple[StoreFeature, ...] = ()   # those with per-layer work, carried by each step
        self.spec = tiers.device.spec
        self.block_size = self.spec.block_size
        # notified when a step commits or aborts: its hidden rebuilds are settled (`_await_rebuilds`)
        self.settled = threading.Condition(sessions.lock)
        self.rebuild_wait = 120.0       # seconds a step waits for another step's rebuild of a shared chunk
        # session -> its entry of the step planned and not yet committed or aborted (what a fork leaves out)
        self.in_flight: dict[str, StepEntry] = {}

    # ---- turns: the one writer of last_turn -------------------------------------------------------

    def begin_turn(self, s: Session, truncated: int) -> TurnStats:
        """A turn starts on `s`, whose history was cut to the prompt's prefix (`truncated` tokens cut)
        and whose disk chunks were proven: count what each tier holds for it. Sets `s.last_turn`."""
        t = TurnStats(truncated_tokens=truncated)
        bs = self.block_size
        for k, c in enumerate(s.chunks):
            n = s.chunk_len(k, bs)
            if c.state is DEVICE or c.shadow is not None:
                t.reused_device += n
            elif c.state is HOST:
                t.swapped_in_host += n
            elif c.state is DISK:
                t.swapped_in_disk += n
            elif c.state in HIDDEN_FORMS:      # K/V rebuilt layer by layer in the turn's first step
                t.restored_hidden += n
        t.reused_tokens = t.reused_device + t.swapped_in_host + t.swapped_in_disk + t.restored_hidden
        s.last_turn, s.in_turn = t, True
        return t

    @staticmethod
    def add_generated(s: Session, n: int) -> None:
        """The turn of `s` generated `n` tokens (the one output count of its last_turn). Outside a
        begun turn it changes nothing: last_turn is then an earlier turn's."""
        if s.in_turn:
            s.last_turn.generated_tokens = n

    # ---- one step --------------------------------------------------------------------------------

    def plan(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
             factors: Sequence[int] | None) -> StepBatch:
        """`KVStore.plan_step`: reserve device blocks for one forward step and describe it.

        `requests`: (session_id, token_ids, positions) per session, at most one per session. A
        position < the session's length recomputes that history token (its id must match); positions
        >= length append new tokens and must continue the history without gaps. Host and disk chunks
        of the context are copied up (layer by layer; on CUDA the step carries per-layer events);
        dropped chunks of the context must be among the rows. The new tokens join the session's
        history now; `commit` makes them permanent, `abort` takes them back.

        `factors` (layerwise_kv stores only; default 1 each): per entry, the keep factor of the chunks
        it fills: 1 all layers on the device, 0 none (host only), f >= 2 layers l % f == r in a
        residue block (`layerwise/chunks.py`). An entry with factor != 1 also reads its HOST context in place.
        """
        sessions = [self.sessions.get(sid) for sid, _, _ in requests]
        if len({s.session_id for s in sessions}) != len(sessions):
            raise ValueError("plan_step: at most one entry per session in a step")
        factors = [1] * len(requests) if factors is None else [check_factor(f, self.spec.num_layers) for f in factors]
        if len(factors) != len(requests):
            raise ValueError(f"plan_step: {len(factors)} factors for {len(requests)} entries")
        self.layered.check_factors(factors)
        bs, device = self.block_size, self.tiers.device
        self._await_rebuilds(sessions)
        for s, (_, _, pos) in zip(sessions, requests):     # disk chunks are proven before they are read
            self.placement.prove(s, range(min(len(s.chunks), -(-(max(pos, default=-1) + 1) // bs))))
        plans = [entry_needs(s, list(ids), list(pos), bs) for s, (_, ids, pos) in zip(sessions, requests)]
        for s, f, (_, swap) in zip(sessions, factors, plans):
            if f != 1:     # layer-wise entry: its host chunks are read in place, not copied up
                swap[:] = [k for k in swap if s.chunks[k].state is not HOST or s.chunks[k].shadow is not None]
        exclude = {s.session_id for s in sessions}
        sharing = self.tiers.sharing            # a chunk shared by sessions of the step counts once
        swaps = sharing.unique((s, k) for s, (_, sw) in zip(sessions, plans) for k in sw)
        fresh = sum(len(f) if fac == 1 else self.layered.blocks_needed(fac, len(f))
                    for fac, (f, _) in zip(factors, plans)) + sum(1 for s, k in swaps if s.chunks[k].shadow is None)
        held = count_chunks(sessions, DEVICE, sharing, shadows=True, idle_only=False)
        if fresh + held > device.num_blocks:
            raise CapacityError(
                f"request needs {fresh + held} device blocks of {bs} tokens but the pool has "
                f"{device.num_blocks} in all ({device.num_blocks * bs} tokens); raise device_capacity")
        n_fill = sum(len(f) for fac, (f, _) in zip(factors, plans) if fac == 1)
        if fresh > device.num_free:
            self.placement.make_room(DEVICE, fresh - device.num_free, exclude)
        restore = self.hidden.new_restore(self.counters)
        try:
            ups = [(s, k) for s, (_, sw) in zip(sessions, plans) for k in sw]
            events = []                    # nothing below the device: no copy, no move recorded
            if ups:
                with self.placement.moving("step"):
                    events = self.swap_in.move_up(ups, DEVICE, exclude, restore=restore)
            fills = iter(self.placement.take(DEVICE, n_fill, exclude,
                                             [(s.session_id, k) for s, fac, (f, _) in zip(sessions, factors, plans)
                                              if fac == 1 for k in f]))
        except BaseException:
            self._unplan_swap_in(restore)
            raise
        layered = []      # per entry: LAYERED chunks for its fills (factor != 1)
        try:
            for s, fac, (f, _) in zip(sessions, factors, plans):
                layered.append(iter(self.layered.fill([(s, k) for k in f], fac, exclude) if fac != 1 else ()))
        except CapacityError:     # give back what this step took so far: nothing is assigned yet
            device.free(list(fills))
            for made in layered:
                for c in made:
                    self.layered.discard(c)
            self._unplan_swap_in(restore)
            raise
        entries, hidden = [], self.hidden
        for s, fac, (_, ids, pos), (fill, swap), made in zip(sessions, factors, requests, plans, layered):
            if fac != 1:
                for k in range(min(len(s.chunks), -(-(max(pos) + 1) // bs))):
                    c = s.chunks[k]
                    if c.state is HOST and c.shadow is None:     # read in place from now on
                        s.chunks[k] = Chunk(LAYERED, c.loc)
            old_len = len(s.token_ids)
            if s.turn_started:   # count what a returning turn found on the device, once per turn
                s.turn_started = False
                self.counters.device_hits += sum(s.chunk_len(k, bs) for k, c in enumerate(s.chunks)
                                                 if c.state is DEVICE and k not in fill and k not in swap
                                                 and k * bs < max(pos))
            self.counters.recomputed += sum(1 for p in pos if p < old_len)
            s.token_ids.extend(t for p, t in zip(pos, ids) if p >= old_len)
            while len(s.chunks) * bs < len(s.token_ids):
                s.chunks.append(Chunk())
            for k in fill:
                self.tiers.release(s, k)
                s.chunks[k] = Chunk(DEVICE, next(fills)) if fac == 1 else next(made)
                hidden.computed(s.chunks[k].loc, captured=True)    # every token of it is computed (captured)
            entries.append(StepEntry(s.session_id, tuple(ids), tuple(pos), old_len, tuple(fill)))
        for s in sessions:          # their chunks are on the device now (making room above prunes the set)
            self.sessions.mark(s.session_id)
        step = self._build(sessions, entries, events, restore)
        self.in_flight.update((e.session_id, e) for e in entries)
        return step

    def _await_rebuilds(self, sessions: list[Session]) -> None:
        """A chunk of these sessions still DEVICE with a `source` is shared with a session whose step is
        in flight on another thread and rebuilds its K/V from hidden states in that forward: its block
        holds no K/V until that step commits (or, aborted, puts it back in its hidden form). Wait for
        that (the store lock is released meanwhile), so that no step reads it before. StoreError if
        it does not settle within `rebuild_wait` seconds (a step planned and never committed)."""
        def pending() -> bool:
            return any(c.source is not None for s in sessions for c in s.chunks)
        if pending() and not self.settled.wait_for(lambda: not pending(), self.rebuild_wait):
            raise StoreError("a step reads a shared chunk another step is rebuilding from hidden states, and that "
                             f"step was neither committed nor aborted within {self.rebuild_wait:g} s")

    def _unplan_swap_in(self, restore: HiddenRestore | None) -> None:
        """`plan` raises after chunks came up for its step: the copies into the device land (those
        chunks hold their KV now and stay there); the hidden-state rebuilds it queued will never run,
        so those chunks go back to their hidden form and their blocks are freed (else they would be
        DEVICE chunks whose blocks hold no KV of theirs)."""
        self.transfer.settle(self.tiers.device)
        self.swap_in.settle(restore, ok=False)
        self.settled.notify_all()

    def commit(self, step: StepBatch) -> None:
        """`KVStore.commit`. Also adds the step's rows to each leased session's last_turn."""
        self.transfer.end_step()                 # the forward is over (emulator: pending copies land)
        for f in self.features:
            f.commit(step)
        now = self.sessions.clock()
        for e in step.entries:
            self.in_flight.pop(e.session_id, None)
            s = self.sessions.find(e.session_id)
            if s is None:
                continue
            self.sessions.touch(s, now)
            self.tiers.sharing.register(s, self.tiers.vacate)    # its new full chunks join the prefix index
            if s.in_turn:                        # a turn's step: its rows count in its last_turn
                turn = s.last_turn
                turn.computed_tokens += len(e.positions)
                turn.recomputed_tokens += sum(1 for p in e.positions if p < e.old_len)
            if not s.busy:                       # e.g. LAYERED chunks live only within a turn
                for f in self.features:
                    f.settle(s)
        self.settled.notify_all()

    def abort(self, step: StepBatch) -> None:
        """`KVStore.abort`: undo `plan`: new tokens leave the history, chunks filled in the step are
        dropped again (chunks it copied up stay on the device: their KV is valid; chunks whose K/V was
        being rebuilt from hidden states stay on the device only if every layer was rebuilt)."""
        self.transfer.end_step()
        for f in self.features:
            f.abort(step)
        for e in step.entries:
            self.in_flight.pop(e.session_id, None)
            s = self.sessions.find(e.session_id)
            if s is None:
                continue
            for k in e.new_blocks:
                if k < len(s.chunks):
                    self.tiers.release(s, k)
            del s.token_ids[e.old_len:]
            del s.chunks[blocks_for(e.old_len, self.block_size):]
            self.sessions.recount(s.session_id)
            if not s.busy:
                for f in self.features:
                    f.settle(s)
        self.settled.notify_all()

    def _build(self, sessions: list[Session], entries: list[StepEntry], events: list,
               restore: HiddenRestore | None = None) -> StepBatch:
        bs, device = self.block_size, self.tiers.device
        dev = device.device
        ids, pos, slots, cu, kv_len, tables = [], [], [], [0], [], []
        for s, e in zip(sessions, entries):
            chunks = s.chunks
            ids += e.token_ids
            pos += e.positions
            # a DEVICE chunk's table block is its block (the common case, read without a call)
            table = [c.loc if c.state is DEVICE else c.table_block for c in chunks[: -(-(max(e.positions) + 1) // bs)]]
            slots += [table[p // bs] * bs + p % bs for p in e.positions]
            cu.append(len(pos))
            kv_len.append(max(e.positions) + 1)
            tables.append(table)
        width = max(map(len, tables))
        paged = PagedBatch(torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64),
                           torch.tensor(kv_len, dtype=torch.int32),
                           torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
        paged.validate(device.num_blocks, bs)
        dense_slots = None
        if self.layout is Layout.VIRTUAL:   # each entry's KV is one contiguous row of its session's slot
            dense_slots = tuple(device.slot_of(e.session_id) for e in entries)
        layer_events = None
        if events:   # per layer, the events of every copy group
            layer_events = tuple(tuple(group[layer] for group in events) for layer in range(self.spec.num_layers))
        layered = self.layered.step_map(sessions, [e.positions for e in entries], tables)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        rows = None       # the K/V writer's row indices, made once here for every layer (a BlockPool's layout)
        if layered is None and isinstance(device, BlockPool) and device.layer_rows(0) is not None:
            rows = device.slot_rows(slot_t)
        return StepBatch(
            entries=tuple(entries), paged=paged.to(dev), slots=slot_t, rows=rows,
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
            pool=device, backend=self.backends.for_step([len(e.positions) for e in entries]),
            windows=self.spec.windows, layer_events=layer_events,
            dense_slots=dense_slots, layered=layered, kernels=self.kernels,
            hidden=self.hidden.step_hidden(slots, restore), features=self.layer_features,
        )
