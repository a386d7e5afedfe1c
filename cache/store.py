"""The session store: owns the pools and the sessions; the one place session KV state changes.

Contract: every public method takes the store lock; state (chunk states, block ownership, token ids)
changes only here. A method that raises leaves the store as it was. `check_integrity()` states the
invariants: every device block is free or owned by exactly one DEVICE chunk of one session.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..kernels import PagedBatch
from .errors import CapacityError, SessionBusyError, UnknownSessionError
from .policy import EvictionPolicy, RetentionPolicy
from .pool import BlockPool
from .session import Chunk, ChunkState, Session, TurnStats
from .spec import KVSpec, capacity_in_blocks
from .step import StepBatch, StepEntry


@dataclass(frozen=True, slots=True)
class StoreStats:
    sessions: int
    device_tokens: int            # tokens whose KV is in the device pool
    dropped_tokens: int           # tokens with only their ids kept
    device_bytes: int             # bytes of device blocks in use
    device_capacity_tokens: int
    device_capacity_bytes: int
    device_free_blocks: int
    block_size: int
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class SessionStats:
    session_id: str
    num_tokens: int
    device_tokens: int
    dropped_tokens: int
    last_turn: TurnStats


class SessionStore:
    def __init__(self, spec: KVSpec, device_capacity: int | str = 4096, *,
                 policy: EvictionPolicy | None = None, attn_backend: str = "torch"):
        self.spec = spec
        self.block_size = spec.block_size
        self.device_pool = BlockPool(spec, capacity_in_blocks(device_capacity, spec))
        self.policy = policy or RetentionPolicy()
        self.attn_backend = attn_backend
        self._sessions: dict[str, Session] = {}
        self._lock = threading.RLock()

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
            self._drop_chunks(s, range(len(s.chunks)))
            del self._sessions[session_id]

    @contextmanager
    def lease(self, session_id: str) -> Iterator[Session]:
        """Mark the session busy for one turn; a second lease raises SessionBusyError."""
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            s.busy = True
        try:
            yield s
        finally:
            with self._lock:
                s.busy = False
                s.last_active = time.monotonic()

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
        with self._lock:
            s = self.session(session_id)
            if not length >= 0:
                raise ValueError(f"cannot truncate to {length} tokens")
            cut = max(len(s.token_ids) - length, 0)
            if cut:
                keep = -(-length // self.block_size)
                self._drop_chunks(s, range(keep, len(s.chunks)))
                del s.chunks[keep:]
                del s.token_ids[length:]
            return cut

    def missing_positions(self, session_id: str) -> list[int]:
        """History positions whose KV is not on the device (they must be restored before use)."""
        with self._lock:
            s = self.session(session_id)
            return [p for k, c in enumerate(s.chunks) if c.state is not ChunkState.DEVICE
                    for p in s.chunk_range(k, self.block_size)]

    def evict(self, session_id: str) -> int:
        """Move the session's device chunks down a tier; returns how many device blocks were freed.

        For now there is no lower tier, so they are dropped (the token ids stay, so the KV can be
        recomputed; `missing_positions` lists them). Allowed on a busy session: the engine suspends a
        running request this way when decoding runs out of blocks, keeping the session's lease.
        """
        with self._lock:
            s = self.session(session_id)
            on_device = [k for k, c in enumerate(s.chunks) if c.state is ChunkState.DEVICE]
            self._drop_chunks(s, on_device)
            return len(on_device)

    def available_blocks(self) -> int:
        """Device blocks a step could get now: the free ones plus those held by idle (non-busy)
        sessions, which `plan_step` may evict. Blocks of busy sessions are not counted."""
        with self._lock:
            idle = sum(1 for s in self._sessions.values() if not s.busy
                       for c in s.chunks if c.state is ChunkState.DEVICE)
            return self.device_pool.num_free + idle

    # ---- steps ----------------------------------------------------------------------------------

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> StepBatch:
        """Reserve device blocks for one forward step and describe it.

        `requests`: (session_id, token_ids, positions) per session, at most one per session. A
        position < the session's length recomputes that history token (its id must match); positions
        >= length append new tokens and must continue the history without gaps. Every other context
        position a row attends to must be on the device. The new tokens join the session's history
        now; `commit` makes them permanent, `abort` takes them (and the blocks) back.
        """
        with self._lock:
            sessions = [self.session(sid) for sid, _, _ in requests]
            if len({s.session_id for s in sessions}) != len(sessions):
                raise ValueError("plan_step: at most one entry per session in a step")
            need: list[list[int]] = []
            for s, (_, ids, pos) in zip(sessions, requests):
                need.append(self._chunks_to_fill(s, list(ids), list(pos)))
            self._reserve(sum(map(len, need)), exclude={s.session_id for s in sessions})
            entries = []
            for s, (sid, ids, pos), chunks in zip(sessions, requests, need):
                old_len = len(s.token_ids)
                new = [t for p, t in zip(pos, ids) if p >= old_len]
                s.token_ids.extend(new)
                while len(s.chunks) * self.block_size < len(s.token_ids):
                    s.chunks.append(Chunk())
                for k, b in zip(chunks, self.device_pool.allocate(len(chunks))):
                    s.chunks[k] = Chunk(ChunkState.DEVICE, b)
                entries.append(StepEntry(sid, tuple(ids), tuple(pos), old_len, tuple(chunks)))
            return self._build(entries)

    def commit(self, step: StepBatch) -> None:
        with self._lock:
            now = time.monotonic()
            for e in step.entries:
                self._sessions[e.session_id].last_active = now

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step`: new tokens leave the history, blocks given in the step return."""
        with self._lock:
            for e in step.entries:
                s = self._sessions.get(e.session_id)
                if s is None:
                    continue
                self._drop_chunks(s, [k for k in e.new_blocks if k < len(s.chunks)])
                del s.token_ids[e.old_len:]
                del s.chunks[-(-e.old_len // self.block_size):]

    # ---- integrity and stats --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless: every device block is free or owned by exactly one DEVICE chunk;
        chunk tables match token counts; only DEVICE chunks hold blocks."""
        with self._lock:
            owner: dict[int, tuple[str, int]] = {}
            for s in self._sessions.values():
                n_chunks = -(-len(s.token_ids) // self.block_size)
                assert len(s.chunks) == n_chunks, (
                    f"{s.session_id}: {len(s.chunks)} chunks for {len(s.token_ids)} tokens")
                for k, c in enumerate(s.chunks):
                    if c.state is ChunkState.DEVICE:
                        assert c.block is not None and 0 <= c.block < self.device_pool.num_blocks, (s.session_id, k, c)
                        assert c.block not in owner, (
                            f"block {c.block} owned by {owner[c.block]} and {(s.session_id, k)}")
                        owner[c.block] = (s.session_id, k)
                    else:
                        assert c.block is None, (s.session_id, k, c)
            free = self.device_pool.free_ids()
            assert len(free) == len(set(free)), "a block is free twice"
            both = set(free) & owner.keys()
            assert not both, f"blocks both free and owned: {sorted(both)}"
            assert len(free) + len(owner) == self.device_pool.num_blocks, (
                f"{self.device_pool.num_blocks - len(free) - len(owner)} device blocks are neither free nor owned")

    def stats(self, session_id: str | None = None) -> StoreStats | SessionStats:
        with self._lock:
            bs = self.block_size
            if session_id is not None:
                s = self.session(session_id)
                return SessionStats(session_id, s.num_tokens, s.tokens_in(ChunkState.DEVICE, bs),
                                    s.tokens_in(ChunkState.DROPPED, bs), s.last_turn)
            pool = self.device_pool
            used = pool.num_blocks - pool.num_free
            return StoreStats(
                sessions=len(self._sessions),
                device_tokens=sum(s.tokens_in(ChunkState.DEVICE, bs) for s in self._sessions.values()),
                dropped_tokens=sum(s.tokens_in(ChunkState.DROPPED, bs) for s in self._sessions.values()),
                device_bytes=used * self.spec.bytes_per_block,
                device_capacity_tokens=pool.num_blocks * bs,
                device_capacity_bytes=pool.num_blocks * self.spec.bytes_per_block,
                device_free_blocks=pool.num_free,
                block_size=bs,
                kv_bytes_per_token=self.spec.bytes_per_token,
            )

    # ---- internals (lock held) ------------------------------------------------------------------

    def _chunks_to_fill(self, s: Session, ids: list[int], pos: list[int]) -> list[int]:
        """Validate one entry; return the chunk indices that need a device block."""
        n, bs = len(s.token_ids), self.block_size
        if len(ids) != len(pos) or not ids:
            raise ValueError(f"session {s.session_id!r}: step needs >= 1 token and one position per token")
        new = [p for p in pos if p >= n]
        if new != list(range(n, n + len(new))) or any(p < 0 for p in pos) or sorted(set(pos)) != sorted(pos):
            raise ValueError(f"session {s.session_id!r}: new positions must continue the history at {n} without gaps")
        for p, t in zip(pos, ids):
            if p < n and s.token_ids[p] != t:
                raise ValueError(f"session {s.session_id!r}: recomputed token at {p} is {t}, "
                                 f"history has {s.token_ids[p]}")
        end = max(pos) + 1
        rows = set(pos)
        fill = []
        for k in range(-(-end // bs)):
            if k < len(s.chunks) and s.chunks[k].state is ChunkState.DEVICE:
                continue
            covered = range(k * bs, min((k + 1) * bs, n))   # history positions of this chunk
            if any(p not in rows for p in covered if p < end):
                raise ValueError(f"session {s.session_id!r}: chunk {k} is {s.chunks[k].state.value}, "
                                 "restore it before attending to it")
            fill.append(k)
        return fill

    def _reserve(self, n_blocks: int, exclude: set[str]) -> None:
        pool = self.device_pool
        held = sum(1 for sid in exclude for c in self._sessions[sid].chunks if c.state is ChunkState.DEVICE)
        if n_blocks + held > pool.num_blocks:
            raise CapacityError(
                f"request needs {n_blocks + held} device blocks of {self.block_size} tokens but the pool has "
                f"{pool.num_blocks} in all ({pool.num_blocks * self.block_size} tokens); raise device_capacity")
        if n_blocks <= pool.num_free:
            return
        idle = [s for s in self._sessions.values() if not s.busy and s.session_id not in exclude]
        victims = []
        for s, k in self.policy.order(idle, self.block_size, time.monotonic()):
            victims.append((s, k))
            if len(victims) >= n_blocks - pool.num_free:
                break
        if len(victims) < n_blocks - pool.num_free:
            raise CapacityError(f"request needs {n_blocks} device blocks; {pool.num_free} are free and only "
                                f"{len(victims)} can be taken from idle sessions (the others are busy)")
        for s, k in victims:
            self._drop_chunks(s, [k])

    def _drop_chunks(self, s: Session, chunks) -> None:
        blocks = []
        for k in chunks:
            c = s.chunks[k]
            if c.state is ChunkState.DEVICE:
                blocks.append(c.block)
            s.chunks[k] = Chunk(ChunkState.DROPPED, None)
        self.device_pool.free(blocks)

    def _build(self, entries: list[StepEntry]) -> StepBatch:
        bs, dev = self.block_size, self.device_pool.device
        ids, pos, slots, cu, kv_len, tables = [], [], [], [0], [], []
        for e in entries:
            s = self._sessions[e.session_id]
            ids += e.token_ids
            pos += e.positions
            slots += [s.chunks[p // bs].block * bs + p % bs for p in e.positions]
            cu.append(len(pos))
            kv_len.append(max(e.positions) + 1)
            tables.append([c.block if c.block is not None else 0 for c in s.chunks[: -(-kv_len[-1] // bs)]])
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        paged = PagedBatch(torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64),
                           torch.tensor(kv_len, dtype=torch.int32), table).to(dev)
        return StepBatch(
            entries=tuple(entries), paged=paged, slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
            pool=self.device_pool, backend=self.attn_backend, window=self.spec.window,
        )
