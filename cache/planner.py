"""Planning one forward step over the store: the store's step methods (a mixin of SessionStore).

Every method holds the store lock. `plan_step` reserves device blocks (moving other sessions' chunks
down by the policy), copies host/disk chunks of the context up, queues hidden chunks for layer-wise
rebuild, appends the new tokens to the history and describes the step; `commit` makes it permanent,
`abort` takes it back. Raising leaves the store unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import PagedBatch
from .errors import CapacityError
from .hidden_states import StepHidden
from .session import Chunk, Session
from .shares import check_factor
from .step import StepBatch, StepEntry
from .tiering import DEVICE, DROPPED, HOST, LAYERED


class StepPlannerMixin:
    # provided by SessionStore: _lock, _sessions, session(), device_pool, block_size, spec, layout,
    # attn_backend, capture, counters, and the tiering/hidden-tier internals

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Reserve device blocks for one forward step and describe it.

        `requests`: (session_id, token_ids, positions) per session, at most one per session. A
        position < the session's length recomputes that history token (its id must match); positions
        >= length append new tokens and must continue the history without gaps. Host and disk chunks
        of the context are copied up (layer by layer; on CUDA the step carries per-layer events);
        dropped chunks of the context must be among the rows. The new tokens join the session's
        history now; `commit` makes them permanent, `abort` takes them back.

        `factors` (layerwise_kv stores only; default 1 each): per entry, the keep factor of the chunks
        it fills: 1 all layers on the device, 0 none (host only), f >= 2 layers l % f == r in a shared
        block (`layerwise.py`). An entry with factor != 1 also reads its HOST context in place.
        """
        with self._lock:
            sessions = [self.session(sid) for sid, _, _ in requests]
            if len({s.session_id for s in sessions}) != len(sessions):
                raise ValueError("plan_step: at most one entry per session in a step")
            factors = [1] * len(requests) if factors is None else [check_factor(f, self.spec.num_layers)
                                                                   for f in factors]
            if len(factors) != len(requests):
                raise ValueError(f"plan_step: {len(factors)} factors for {len(requests)} entries")
            if not self.layerwise and any(f != 1 for f in factors):
                raise ValueError("plan_step: keep factors other than 1 need a store made with layerwise_kv=True")
            for s, (_, _, pos) in zip(sessions, requests):     # disk chunks are proven before they are read
                self._verify_disk(s, range(min(len(s.chunks), -(-(max(pos, default=-1) + 1) // self.block_size))))
            plans = [self._plan_entry(s, list(ids), list(pos)) for s, (_, ids, pos) in zip(sessions, requests)]
            for s, f, (_, swap) in zip(sessions, factors, plans):
                if f != 1:     # layer-wise entry: its host chunks are read in place, not copied up
                    swap[:] = [k for k in swap if s.chunks[k].state is not HOST or s.chunks[k].shadow is not None]
            exclude = {s.session_id for s in sessions}
            swaps = self.sharing.unique((s, k) for s, (_, sw) in zip(sessions, plans) for k in sw)
            fresh = sum(len(f) if fac == 1 else self.shares.blocks_needed(fac, len(f))
                        for fac, (f, _) in zip(factors, plans)) + sum(1 for s, k in swaps if s.chunks[k].shadow is None)
            held = sum(1 for _, _, c in self.sharing.physical(sessions) if c.state is DEVICE or c.shadow is not None)
            if fresh + held > self.device_pool.num_blocks:
                raise CapacityError(
                    f"request needs {fresh + held} device blocks of {self.block_size} tokens but the pool has "
                    f"{self.device_pool.num_blocks} in all ({self.device_pool.num_blocks * self.block_size} tokens); "
                    "raise device_capacity")
            n_fill = sum(len(f) for fac, (f, _) in zip(factors, plans) if fac == 1)
            if fresh > self.device_pool.num_free:
                self._make_room(DEVICE, fresh - self.device_pool.num_free, exclude)
            restore = self._new_restore()
            with self._moving("step"):
                events = self._move_up([(s, k) for s, (_, sw) in zip(sessions, plans) for k in sw], DEVICE,
                                       exclude, restore=restore)
            fills = iter(self._take(DEVICE, n_fill, exclude,
                                    [(s.session_id, k) for s, fac, (f, _) in zip(sessions, factors, plans)
                                     if fac == 1 for k in f]))
            layered = []      # per entry: LAYERED chunks for its fills (factor != 1)
            try:
                for s, fac, (f, _) in zip(sessions, factors, plans):
                    layered.append(iter(self._fill_layered([(s, k) for k in f], fac, exclude) if fac != 1 else ()))
            except CapacityError:     # give back what this step took so far: nothing is assigned yet
                self.device_pool.free(list(fills))
                for made in layered:
                    for c in made:
                        self._release_chunk(c)
                raise
            entries = []
            for s, fac, (_, ids, pos), (fill, swap), made in zip(sessions, factors, requests, plans, layered):
                if fac != 1:
                    for k in range(min(len(s.chunks), -(-(max(pos) + 1) // self.block_size))):
                        c = s.chunks[k]
                        if c.state is HOST and c.shadow is None:     # read in place from now on
                            s.chunks[k] = Chunk(LAYERED, c.loc)
                old_len = len(s.token_ids)
                if s.turn_started:   # count what a returning turn found on the device, once per turn
                    s.turn_started = False
                    self.counters.device_hits += sum(self._ntok(s, k) for k, c in enumerate(s.chunks)
                                                     if c.state is DEVICE and k not in fill and k not in swap
                                                     and k * self.block_size < max(pos))
                recomputed = sum(1 for p in pos if p < old_len)
                self.counters.recomputed += recomputed
                s.token_ids.extend(t for p, t in zip(pos, ids) if p >= old_len)
                while len(s.chunks) * self.block_size < len(s.token_ids):
                    s.chunks.append(Chunk())
                for k in fill:
                    self._release(s, k)
                    s.chunks[k] = Chunk(DEVICE, next(fills)) if fac == 1 else next(made)
                    if self.capture is not None:     # every token of it is computed while capturing
                        self.capture.valid[s.chunks[k].loc] = True
                entries.append(StepEntry(s.session_id, tuple(ids), tuple(pos), old_len, tuple(fill)))
            self._sync_disk()
            return self._build(entries, events, restore)

    def commit(self, step: StepBatch) -> None:
        with self._lock:
            self.transfer.end_step()                 # the forward is over (emulator: pending copies land)
            if step.hidden is not None:
                step.hidden.flush()                  # captured rows (CUDA: side-stream copies) reach the buffer
            if step.layered is not None:
                step.layered.flush()                 # staged mode: rows of host layers reach the host now
            restore = step.hidden.restore if step.hidden is not None else None
            if restore is not None:
                restore.finish(self.device_pool)     # layers a forward did not reach, if any
                self._settle_restore(restore, ok=True)
            now = self.clock()
            for e in step.entries:
                if e.session_id in self._sessions:
                    self._sessions[e.session_id].last_active = now
                    self.sharing.register(self._sessions[e.session_id], self._vacate)
                    if not self._sessions[e.session_id].busy:     # LAYERED chunks live only within a turn
                        self._settle_layered(self._sessions[e.session_id])
            if getattr(self, "page_mapper", None) is not None:
                self.page_mapper.submit(self._growth_blocks(step))

    def _growth_blocks(self, step: StepBatch) -> list[tuple[str, int]]:
        """(session, chunk) of the block each session of the step grows into next, once its last
        block is at least half full (or full): what the background mapper maps ahead."""
        bs, out = self.block_size, []
        for sid in dict.fromkeys(e.session_id for e in step.entries):
            s = self._sessions.get(sid)
            if s is not None and (s.num_tokens % bs == 0 or s.num_tokens % bs >= bs // 2):
                out.append((sid, -(-s.num_tokens // bs)))
        return out

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step`: new tokens leave the history, chunks filled in the step are dropped again
        (chunks it copied up stay on the device: their KV is valid; chunks whose K/V was being
        rebuilt from hidden states stay on the device only if every layer was rebuilt)."""
        with self._lock:
            self.transfer.end_step()
            if step.hidden is not None:
                step.hidden.flush()
            if step.layered is not None:
                step.layered.discard()
            restore = step.hidden.restore if step.hidden is not None else None
            if restore is not None:
                self._settle_restore(restore, ok=restore.complete)
            for e in step.entries:
                s = self._sessions.get(e.session_id)
                if s is None:
                    continue
                for k in e.new_blocks:
                    if k < len(s.chunks):
                        self._release(s, k)
                del s.token_ids[e.old_len:]
                del s.chunks[-(-e.old_len // self.block_size):]
                if not s.busy:
                    self._settle_layered(s)

    def _plan_entry(self, s: Session, ids: list[int], pos: list[int]) -> tuple[list[int], list[int]]:
        """Validate one entry; return (chunks the rows fill: need a fresh block, chunks to copy up)."""
        n, bs = len(s.token_ids), self.block_size
        if len(ids) != len(pos) or not ids:
            raise ValueError(f"session {s.session_id!r}: step needs >= 1 token and one position per token")
        new = [p for p in pos if p >= n]
        if new != list(range(n, n + len(new))) or min(pos) < 0 or len(set(pos)) != len(pos):
            raise ValueError(f"session {s.session_id!r}: new positions must continue the history at {n} without gaps")
        for p, t in zip(pos, ids):
            if p < n and s.token_ids[p] != t:
                raise ValueError(f"session {s.session_id!r}: recomputed token at {p} is {t}, "
                                 f"history has {s.token_ids[p]}")
        rows, end = set(pos), max(pos) + 1
        fill, swap = [], []
        for k in range(-(-end // bs)):
            state = s.chunks[k].state if k < len(s.chunks) else DROPPED
            if state is DEVICE or state is LAYERED:     # readable in place (LAYERED: layer by layer)
                continue
            history = [p for p in range(k * bs, min((k + 1) * bs, n, end))]
            if all(p in rows for p in history):
                fill.append(k)                 # every stored token of it is recomputed: fresh block
            elif state is DROPPED:
                raise ValueError(f"session {s.session_id!r}: chunk {k} is dropped; its positions must be "
                                 "recomputed in the step (missing_positions)")
            else:
                swap.append(k)
        return fill, swap

    def _build(self, entries: list[StepEntry], events: list, restore=None) -> StepBatch:
        bs, dev = self.block_size, self.device_pool.device
        ids, pos, slots, cu, kv_len, tables = [], [], [], [0], [], []
        for e in entries:
            s = self._sessions[e.session_id]
            ids += e.token_ids
            pos += e.positions
            slots += [self._table_block(s.chunks[p // bs]) * bs + p % bs for p in e.positions]
            cu.append(len(pos))
            kv_len.append(max(e.positions) + 1)
            tables.append([self._table_block(c) for c in s.chunks[: -(-kv_len[-1] // bs)]])
        width = max(map(len, tables))
        paged = PagedBatch(torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64),
                           torch.tensor(kv_len, dtype=torch.int32),
                           torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
        paged.validate(self.device_pool.num_blocks, bs)
        dense_slots = None
        if self.layout == "virtual":   # each entry's KV is one contiguous row of its session's slot
            dense_slots = tuple(self.device_pool.slot_of(e.session_id) for e in entries)
        layer_events = None
        if events:   # per layer, the events of every copy group
            layer_events = tuple(tuple(group[layer] for group in events) for layer in range(self.spec.num_layers))
        layered = self._layered_step(entries, tables) if self.layerwise else None
        return StepBatch(
            entries=tuple(entries), paged=paged.to(dev), slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
            pool=self.device_pool, backend=self.attn_backend, windows=self.spec.windows, layer_events=layer_events,
            dense_slots=dense_slots, layered=layered, kernels=self.kernels,
            hidden=None if self.capture is None else StepHidden(
                self.capture, torch.tensor(slots, dtype=torch.long), restore if restore and restore.chunks else None),
        )

