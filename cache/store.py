"""The session store: owns the pools and the sessions; the one place session KV state changes.

Contract: every public method takes the store lock; chunk states, slot ownership and token ids
change only here. A method that raises leaves every session's token ids as they were and the
invariants of `check_integrity()` intact: every slot of every tier is free or owned by exactly one
chunk (device blocks: by a DEVICE chunk, or as the cached `shadow` of one HOST chunk).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..kernels import PagedBatch
from .disk import DiskTier
from .errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .hidden import HiddenSpec, Projector, StepHidden
from .hidden_tier import HiddenTierMixin
from .policy import EvictionPolicy, RetentionPolicy
from .pool import BlockPool
from .session import TIERS, Chunk, ChunkState, Session
from .spec import KVSpec, capacity_in_blocks
from .stats import Counters, SessionStats, StoreStats, summary
from .step import StepBatch, StepEntry
from .tiering import DEVICE, DISK, DROPPED, HIDDEN, HOST, SHADOWED, TieringMixin
from .transfer import Transfer
from .virtual import VirtualPool


class SessionStore(TieringMixin, HiddenTierMixin):
    """device_capacity / host_capacity / disk_capacity: tokens (int) or sizes ("2GiB"); a host or
    disk tier exists only when given (the disk tier also needs `disk_dir`). `swap_out_threshold`:
    share of device blocks kept free or reclaimable by ahead-of-time swap-out after each turn.
    hidden_states ("auto" | "always" | "never"), hidden_spec, hidden_capacity (default: host_capacity)
    and project (hidden -> K/V per layer): HCache's hidden-state tier, see `hidden_tier.py`."""

    def __init__(self, spec: KVSpec, device_capacity: int | str = 4096, *, host_capacity: int | str | None = None,
                 disk_dir: str | os.PathLike | None = None, disk_capacity: int | str | None = None,
                 policy: EvictionPolicy | None = None, attn_backend: str = "torch",
                 swap_out_threshold: float = 0.25, hidden_states: str = "never",
                 hidden_spec: HiddenSpec | None = None, hidden_capacity: int | str | None = None,
                 project: Projector | None = None, layout: str = "paged", max_context: int | None = None):
        if not 0 <= swap_out_threshold < 1:
            raise ValueError(f"swap_out_threshold must be in [0, 1), got {swap_out_threshold}")
        if disk_capacity is not None and disk_dir is None:
            raise ValueError("disk_capacity needs a disk_dir")
        self.spec = spec
        self.block_size = spec.block_size
        if layout == "paged":
            self.device_pool = BlockPool(spec, capacity_in_blocks(device_capacity, spec))
        elif layout == "virtual":
            if max_context is None:
                raise ValueError("layout='virtual' needs max_context (tokens per session slot)")
            self.device_pool = VirtualPool(spec, capacity_in_blocks(device_capacity, spec), max_context)
        else:
            raise ValueError(f"unknown layout {layout!r}; choose 'paged' or 'virtual'")
        self.layout = layout
        self.host_pool = None if host_capacity is None else BlockPool(
            spec, capacity_in_blocks(host_capacity, spec), "cpu", pin_memory=spec.device.type == "cuda")
        self.disk = None if disk_dir is None else DiskTier(
            spec, disk_dir, capacity_in_blocks(disk_capacity if disk_capacity is not None else "1GiB", spec))
        self.policy = policy or RetentionPolicy()
        self.attn_backend = attn_backend
        self.swap_out_threshold = swap_out_threshold
        self.transfer = Transfer(self.device_pool.device)
        self.counters = Counters()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.RLock()
        self._disk_dirty = False
        self._init_hidden(hidden_states, hidden_spec, hidden_capacity, host_capacity, project)
        if self.disk is not None:
            self._load_disk_sessions()

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise UnknownSessionError(session_id) from None

    def open(self, session_id: str) -> Session:
        """Return the session, creating an empty one if it does not exist."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        with self._lock:
            if session_id not in self._sessions:
                self._sessions[session_id] = Session(session_id)
            return self._sessions[session_id]

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def delete(self, session_id: str) -> None:
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            for k in range(len(s.chunks)):
                self._release(s, k)
            del self._sessions[session_id]
            self._sync_disk()

    @contextmanager
    def lease(self, session_id: str) -> Iterator[Session]:
        """Mark the session busy for one turn; a second lease raises SessionBusyError. When the turn
        ends, chunks move down ahead of time if free device blocks fell under the threshold."""
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            s.busy = s.turn_started = True
        try:
            yield s
        finally:
            with self._lock:
                s.busy = s.turn_started = False
                s.last_active = time.monotonic()
                self._swap_out_ahead()
                self._sync_disk()

    # ---- history --------------------------------------------------------------------------------

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the session's history and `token_ids`."""
        s = self.session(session_id)
        n = 0
        for a, b in zip(s.token_ids, token_ids):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, session_id: str, length: int) -> int:
        """Cut the session's history to its first `length` tokens; returns how many were cut."""
        if length < 0:
            raise ValueError(f"cannot truncate to {length} tokens")
        with self._lock:
            s = self.session(session_id)
            cut = max(len(s.token_ids) - length, 0)
            if cut:
                keep = -(-length // self.block_size)
                for k in range(keep, len(s.chunks)):
                    self._release(s, k)
                del s.chunks[keep:]
                del s.token_ids[length:]
                if s.chunks and s.chunks[-1].state is DISK:
                    self._disk_dirty = True
                self._sync_disk()
            return cut

    def missing_positions(self, session_id: str) -> list[int]:
        """History positions whose KV is stored nowhere (DROPPED): a step must recompute them.
        Host and disk chunks are not missing: `plan_step` copies them up."""
        with self._lock:
            s = self.session(session_id)
            return [p for k, c in enumerate(s.chunks) if c.state is DROPPED for p in s.chunk_range(k, self.block_size)]

    def residency(self, session_id: str) -> dict[str, int]:
        """Tokens of the session per tier."""
        with self._lock:
            return self.session(session_id).residency(self.block_size)

    # ---- movement -------------------------------------------------------------------------------

    def move(self, session_id: str, chunks: Iterable[int], tier: str) -> None:
        """Move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk",
        "dropped"). An operator and test hook; making room moves other idle sessions' chunks down by
        the policy. Dropped chunks cannot move up (only their ids remain: the next turn recomputes
        them). Only device chunks whose hidden states were captured become "hidden"; hidden chunks
        move to the device (K/V rebuilt by projection) or are dropped."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
        target = ChunkState(tier)
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            ks = sorted(set(chunks))
            if any(not 0 <= k < len(s.chunks) for k in ks):
                raise IndexError(f"session {session_id!r} has chunks 0..{len(s.chunks) - 1}, got {ks}")
            if target is HIDDEN:
                self._check_hidden_source([(s, k) for k in ks if s.chunks[k].state is DEVICE], DEVICE)
            if target is not DROPPED and self._pool(target) is None:
                raise ValueError(f"this store has no {tier} tier")
            ks = [k for k in ks if s.chunks[k].state is not target]
            if target is HIDDEN and any(s.chunks[k].state is not DEVICE for k in ks):
                raise ValueError(f"session {session_id!r}: only device chunks can become hidden (host and disk "
                                 "chunks keep K/V only; their hidden states are gone)")
            if target not in (DEVICE, DROPPED) and any(s.chunks[k].state is HIDDEN for k in ks):
                raise ValueError(f"session {session_id!r}: hidden chunks move to the device (their K/V is rebuilt "
                                 "there) or are dropped")
            if target is not DROPPED and any(s.chunks[k].state is DROPPED for k in ks):
                raise ValueError(f"session {session_id!r}: dropped chunks keep only token ids and cannot move "
                                 f"to {tier}; the next turn recomputes them")
            up = [k for k in ks if list(ChunkState).index(s.chunks[k].state) > list(ChunkState).index(target)]
            down = [k for k in ks if k not in up]
            excl = {session_id}
            groups = {state: [(s, k) for k in down if s.chunks[k].state is state]
                      for state in (DEVICE, HOST, HIDDEN, DISK)}
            for state, items in groups.items():
                self._move_down(items, state, excl, target=target, strict=True)
            if up:
                restore = self._new_restore()
                self._move_up([(s, k) for k in up], target, excl, restore=restore)
                if restore is not None:
                    restore.finish(self.device_pool)
                    self._settle_restore(restore, ok=True)
                self.transfer.synchronize()
            self._sync_disk()

    def evict(self, session_id: str) -> int:
        """Move the session's device chunks one tier down (host if present, else dropped); returns
        the device blocks freed. Allowed on a busy session: the engine suspends a running request
        this way when decoding runs out of blocks, keeping the session's lease."""
        with self._lock:
            s = self.session(session_id)
            items = [(s, k) for k, c in enumerate(s.chunks) if c.state is DEVICE]
            self._move_down(items, DEVICE, {session_id})
            for k, c in enumerate(s.chunks):          # cached shadows of host chunks go too
                if c.shadow is not None:
                    self.device_pool.free([c.shadow])
                    c.shadow = None
                    items.append((s, k))
            self._sync_disk()
            return len(items)

    def available_blocks(self) -> int:
        """Device blocks a step could get now: free, cached shadows of idle sessions, and device
        chunks of idle sessions (which `plan_step` moves down). Busy sessions' blocks do not count."""
        with self._lock:
            idle = sum(1 for s in self._sessions.values() if not s.busy for c in s.chunks
                       if c.state is DEVICE or c.shadow is not None)
            return self.device_pool.num_free + idle

    def available_slots(self, session_id: str) -> int | None:
        """Virtual layout: device slots a step could still give to new sessions (free ones plus those
        held by idle sessions), or a large number when `session_id` already holds one. None for the
        paged layout, where only blocks count."""
        if self.layout != "virtual":
            return None
        with self._lock:
            pool = self.device_pool
            if pool.slot_of(session_id) is not None:
                return pool.num_slots
            idle = sum(1 for s in self._sessions.values() if not s.busy and pool.slot_of(s.session_id) is not None)
            return pool.free_slots + idle

    def maintain(self) -> None:
        """Run ahead-of-time swap-out now (it also runs whenever a lease ends)."""
        with self._lock:
            self._swap_out_ahead()
            self._sync_disk()

    # ---- steps ----------------------------------------------------------------------------------

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> StepBatch:
        """Reserve device blocks for one forward step and describe it.

        `requests`: (session_id, token_ids, positions) per session, at most one per session. A
        position < the session's length recomputes that history token (its id must match); positions
        >= length append new tokens and must continue the history without gaps. Host and disk chunks
        of the context are copied up (layer by layer; on CUDA the step carries per-layer events);
        dropped chunks of the context must be among the rows. The new tokens join the session's
        history now; `commit` makes them permanent, `abort` takes them back.
        """
        with self._lock:
            sessions = [self.session(sid) for sid, _, _ in requests]
            if len({s.session_id for s in sessions}) != len(sessions):
                raise ValueError("plan_step: at most one entry per session in a step")
            plans = [self._plan_entry(s, list(ids), list(pos)) for s, (_, ids, pos) in zip(sessions, requests)]
            exclude = {s.session_id for s in sessions}
            fresh = sum(len(f) + sum(1 for k in sw if s.chunks[k].shadow is None)
                        for s, (f, sw) in zip(sessions, plans))
            held = sum(1 for s in sessions for c in s.chunks if c.state is DEVICE or c.shadow is not None)
            if fresh + held > self.device_pool.num_blocks:
                raise CapacityError(
                    f"request needs {fresh + held} device blocks of {self.block_size} tokens but the pool has "
                    f"{self.device_pool.num_blocks} in all ({self.device_pool.num_blocks * self.block_size} tokens); "
                    "raise device_capacity")
            n_fill = sum(len(f) for f, _ in plans)
            if fresh > self.device_pool.num_free:
                self._make_room(DEVICE, fresh - self.device_pool.num_free, exclude)
            restore = self._new_restore()
            events = self._move_up([(s, k) for s, (_, sw) in zip(sessions, plans) for k in sw], DEVICE, exclude,
                                   restore=restore)
            fills = self._take(DEVICE, n_fill, exclude,
                               [(s.session_id, k) for s, (f, _) in zip(sessions, plans) for k in f][::-1])
            entries = []
            for s, (_, ids, pos), (fill, swap) in zip(sessions, requests, plans):
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
                    s.chunks[k] = Chunk(DEVICE, fills.pop())
                    if self.capture is not None:     # every token of it is computed while capturing
                        self.capture.valid[s.chunks[k].loc] = True
                entries.append(StepEntry(s.session_id, tuple(ids), tuple(pos), old_len, tuple(fill)))
            self._sync_disk()
            return self._build(entries, events, restore)

    def commit(self, step: StepBatch) -> None:
        with self._lock:
            restore = step.hidden.restore if step.hidden is not None else None
            if restore is not None:
                restore.finish(self.device_pool)     # layers a forward did not reach, if any
                self._settle_restore(restore, ok=True)
            now = time.monotonic()
            for e in step.entries:
                if e.session_id in self._sessions:
                    self._sessions[e.session_id].last_active = now

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step`: new tokens leave the history, chunks filled in the step are dropped again
        (chunks it copied up stay on the device: their KV is valid; chunks whose K/V was being
        rebuilt from hidden states stay on the device only if every layer was rebuilt)."""
        with self._lock:
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
            if state is DEVICE:
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
            slots += [s.chunks[p // bs].loc * bs + p % bs for p in e.positions]
            cu.append(len(pos))
            kv_len.append(max(e.positions) + 1)
            tables.append([c.loc for c in s.chunks[: -(-kv_len[-1] // bs)]])
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
        return StepBatch(
            entries=tuple(entries), paged=paged.to(dev), slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
            pool=self.device_pool, backend=self.attn_backend, window=self.spec.window, layer_events=layer_events,
            dense_slots=dense_slots,
            hidden=None if self.capture is None else StepHidden(
                self.capture, torch.tensor(slots, dtype=torch.long), restore if restore and restore.chunks else None),
        )

    # ---- integrity and stats --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot of every tier is free or owned by exactly one chunk,
        chunk tables match token counts, and only HOST/HIDDEN chunks have shadows."""
        with self._lock:
            owners: dict[ChunkState, dict[int, tuple[str, int]]] = {DEVICE: {}, HOST: {}, HIDDEN: {}, DISK: {}}

            def own(tier, slot, who):
                pool = self._pool(tier)
                assert pool is not None, f"{who} is {tier.value} but the store has no such tier"
                assert 0 <= slot < pool.num_blocks, f"{who}: {tier.value} slot {slot} out of range"
                assert slot not in owners[tier], f"{tier.value} slot {slot} owned by {owners[tier][slot]} and {who}"
                owners[tier][slot] = who

            for s in self._sessions.values():
                n_chunks = -(-len(s.token_ids) // self.block_size)
                assert len(s.chunks) == n_chunks, (
                    f"{s.session_id}: {len(s.chunks)} chunks for {len(s.token_ids)} tokens")
                for k, c in enumerate(s.chunks):
                    who = (s.session_id, k)
                    if c.state is DROPPED:
                        assert c.loc is None and c.shadow is None, (who, c)
                    else:
                        assert c.loc is not None, (who, c)
                        own(c.state, c.loc, who)
                    if c.shadow is not None:
                        assert c.state in SHADOWED, f"{who}: only host/hidden chunks keep a device shadow, {c}"
                        own(DEVICE, c.shadow, who)
                    if c.source is not None:
                        assert c.state is DEVICE, f"{who}: only device chunks are rebuilt from a hidden slot, {c}"
                        own(HIDDEN, c.source, who)
            for tier, owned in owners.items():
                pool = self._pool(tier)
                if pool is not None:
                    try:
                        pool.check(set(owned))
                    except AssertionError as e:
                        raise AssertionError(f"{tier.value} tier: {e}") from None

    def stats(self, session_id: str | None = None) -> StoreStats | SessionStats:
        with self._lock:
            bs = self.block_size
            if session_id is not None:
                s = self.session(session_id)
                r = s.residency(bs)
                return SessionStats(session_id, s.num_tokens, r["device"], r["host"] + r["hidden"], r["disk"],
                                    r["dropped"], s.busy, s.last_turn, hidden_tokens=r["hidden"])
            tot = {t: 0 for t in TIERS}
            for s in self._sessions.values():
                for t, n in s.residency(bs).items():
                    tot[t] += n
            cached = sum(s.chunk_len(k, bs) for s in self._sessions.values()
                         for k, c in enumerate(s.chunks) if c.shadow is not None)
            per_block = self.spec.bytes_per_block

            def used(pool):
                return 0 if pool is None else (pool.num_blocks - pool.num_free) * per_block

            def cap(pool):
                return 0 if pool is None else pool.num_blocks * bs

            disk_pool = self.disk.pool if self.disk is not None else None
            hid = self.hidden_pool
            return StoreStats(
                sessions=len(self._sessions), device_tokens=tot["device"], host_tokens=tot["host"] + tot["hidden"],
                disk_tokens=tot["disk"], dropped_tokens=tot["dropped"], device_cached_tokens=cached,
                device_bytes=used(self.device_pool), host_bytes=used(self.host_pool) + self._hidden_used_bytes(),
                disk_bytes=used(disk_pool), device_capacity_tokens=cap(self.device_pool),
                host_capacity_tokens=cap(self.host_pool) + cap(hid),
                disk_capacity_tokens=cap(disk_pool), device_free_blocks=self.device_pool.num_free,
                block_size=bs, kv_bytes_per_token=self.spec.bytes_per_token,
                counters=Counters(**{f: getattr(self.counters, f) for f in Counters.__slots__}),
                hidden_tokens=tot["hidden"], hidden_bytes=self._hidden_used_bytes(), hidden_capacity_tokens=cap(hid),
                hidden_bytes_per_token=0 if hid is None else hid.hidden_spec.bytes_per_token,
                device_reserved_bytes=self.device_pool.bytes,
                device_committed_bytes=self.device_pool.committed_bytes() if self.layout == "virtual"
                else self.device_pool.bytes,
                device_pages_released=getattr(self.device_pool, "pages_released", 0),
            )

    def summary(self) -> str:
        """The store's tiers and traffic, for a person."""
        return summary(self.stats())

    # ---- disk persistence -----------------------------------------------------------------------

    def _sync_disk(self) -> None:
        if self.disk is None or not self._disk_dirty:
            return
        self.disk.write_index({
            s.session_id: {"token_ids": s.token_ids,
                           "disk_chunks": {str(k): c.loc for k, c in enumerate(s.chunks) if c.state is DISK}}
            for s in self._sessions.values() if any(c.state is DISK for c in s.chunks)})
        self._disk_dirty = False

    def _load_disk_sessions(self) -> None:
        taken = []
        for sid, saved in self.disk.saved_sessions.items():
            s = Session(sid, list(saved["token_ids"]))
            s.chunks = [Chunk() for _ in range(-(-len(s.token_ids) // self.block_size))]
            for k, slot in saved["disk_chunks"].items():
                k = int(k)
                if not (0 <= k < len(s.chunks) and 0 <= slot < self.disk.pool.num_blocks):
                    raise StoreError(f"disk tier index names chunk {k} slot {slot} of {sid!r} out of range")
                s.chunks[k] = Chunk(DISK, slot)
                taken.append(slot)
            self._sessions[sid] = s
        self.disk.pool.take(taken)

    def close(self) -> None:
        """Write the disk index and release the disk tier's lock (device and host contents are lost)."""
        with self._lock:
            if self.disk is not None:
                self._disk_dirty = True
                self._sync_disk()
                self.disk.close()
