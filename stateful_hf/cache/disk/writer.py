"""The disk writer: copies of chunks served from above, written to the disk tier behind the turns
(write-behind) and on close (the flush), so a restart finds the live sessions.

Write-behind (`disk_write="behind"`): when a session's turn ends (`note`), its KV chunks on the
device or the host that have no valid disk copy (full chunks and the partial last one; a copy of a
partial chunk goes stale when it grows and is rewritten at a later turn's end) are due
`write_behind_delay` seconds later. A daemon thread (started on demand, gone when nothing is due)
takes each due batch in three phases:
  1. under the store lock (`_stage`): free stale copies (`DiskCopies.sweep`), pick the due idle
     sessions' chunks, allocate free disk slots (never limbo's, never by evicting) and staging slots
     (the bounded queue: `write_behind_queue`), and issue the copies into the staging pool through the
     transfer engine (rule 3 holds the source blocks; on CUDA the compute stream then waits for the copy,
     so a block is not rewritten before it is read; the emulator performs it at once). What does not fit
     is skipped and counted (`skipped`), never waited for;
  2. without the store lock (`_write`): wait for the copies, `pwrite` each layer's slots into the KV file
     (one write per run of slots), `fdatasync` once, checksum each slot for its identity tag;
  3. under the store lock (`_record`): each copy whose chunk is unchanged (same object, same tag, not on
     disk itself) becomes a `DiskCopy` (its checksum set, proven); the others' slots are freed (no index
     ever named them); then one index commit for the batch (`DiskState.sync`).
So the crash ordering of `disk/tier.py` holds: a slot is named by a committed index only after its data
was flushed, and a slot a committed index names is never rewritten (copies free into limbo).

The flush (`flush`, from `KVStore.close` / `KVStore.flush`): the same copies, synchronously under the
store lock, most recently active sessions first, in batches (one `fdatasync` each) until `deadline`;
then one commit. What is left is said in one log line and recomputed after a restart.

The writer is the disk tier's registered feature (`StoreFeature`): a lease's end notes the session
(`released`), a store method that may change the disk state commits its index (`sync`), the store's
close stops write-behind (`stop`) and, after its flush, commits and closes the tier (`close`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..audit.stats import FlushReport
from ..errors import StoreError
from ..feature import StoreFeature
from ..pools.pool import BlockPool
from ..pools.tier_pools import TierPools
from ..sessions.session import Chunk, ChunkState, Session, SessionTable
from .copies import DiskCopy
from .file import identity_tags
from .state import DiskState

log = logging.getLogger("stateful_hf.cache.disk")
DEVICE, HOST = ChunkState.DEVICE, ChunkState.HOST
FLUSH_BATCH = 256          # chunks per flush batch: one fdatasync each, the deadline checked between them

Item = tuple[Session, int, Chunk, bytes]     # (session, chunk index, the chunk object, its identity tag)


@dataclass(slots=True)
class WriterStats:
    """The writer's counters (chunks): copied behind, skipped (queue or disk full), dropped (their chunk
    changed while copied), failed (a failed flush), batches committed."""

    written: int = 0
    skipped: int = 0
    dropped: int = 0
    failed: int = 0
    batches: int = 0


class DiskWriter(StoreFeature):
    """Copies chunks served from above to the disk tier (`state.copies`). `behind`: write-behind runs
    (else only `flush`). `queue_blocks`: the staging pool's slots (the queue's cap). Methods marked
    "lock held" run under the store lock `lock`; the thread takes it itself."""

    def __init__(self, lock, sessions: SessionTable, tiers: TierPools, state: DiskState, behind: bool,
                 delay: float, queue_blocks: int):
        self.lock, self.sessions, self.tiers, self.state = lock, sessions, tiers, state
        self.transfer, self.disk, self.copies = state.transfer, state.disk, state.copies
        self.behind, self.delay, self.block_size = behind, delay, state.block_size
        spec = tiers.device.spec
        self.staging = BlockPool(spec, max(queue_blocks, 1), "cpu", pin_memory=spec.device.type == "cuda",
                                 transfer=self.transfer)
        self.stats = WriterStats()
        self._due: dict[str, float] = {}         # session id -> time.monotonic() its copies are due
        self._commit_at: float | None = None     # time.monotonic() a deferred commit (`sync`) is due
        self.deferred = 0                        # commits deferred off a store method's path (`sync`)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ---- the disk tier's hooks (`StoreFeature`) ------------------------------------------------

    def released(self, s: Session) -> None:
        self.note(s.session_id)            # write-behind: its chunks' disk copies are due after the delay

    def sync(self) -> None:
        """A store method's commit (never raises: a failed commit degrades the tier). With write-behind running,
        a change that only freed slots into limbo or dropped rows (a returning turn's disk chunks moved up: its
        first step) waits for the writer's next commit, `delay` seconds on at the latest, off the turns' path
        (an fsync: ~20 ms for a process's first; the thread is started by the turn's end, `note`, or the next
        store change that commits); until then the committed index stays true (limbo's slots are
        not rewritten before a commit forgets them; making room commits at once). Any other change commits now."""
        if self.behind and not self._stopped and not self.state.urgent:
            if self.state.pending and self._commit_at is None:
                self.deferred += 1
                self._commit_at = time.monotonic() + self.delay
                if self._thread is not None and self._thread.is_alive():
                    self._wake.set()       # else the turn's end (`note`) starts the thread: no start on a step
            return
        self.state.sync()

    def close(self) -> None:
        self.state.sync(force=True)        # best effort: the last committed index stays true
        self.disk.close()                  # the copies keep their slots, as disk chunks do: integrity holds

    # ---- write-behind --------------------------------------------------------------------------

    def note(self, session_id: str) -> None:
        """The session's turn ended (lock held): its chunks are due `delay` seconds from now."""
        if not self.behind or self._stopped:
            return
        self._due[session_id] = time.monotonic() + self.delay
        self._kick()

    def _kick(self) -> None:
        """Start the thread, or wake it (lock held)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="stateful-hf-disk-writer", daemon=True)
            self._thread.start()
        else:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            with self.lock:
                if self._commit_at is not None and self._commit_at <= time.monotonic():
                    self._commit_at = None
                    self.state.sync()
                if not self._due and self._commit_at is None:
                    self._thread = None
                    return
                wait = min([*self._due.values(), *([self._commit_at] if self._commit_at is not None else [])]) \
                    - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self.write_due()

    def write_due(self, now: bool = False) -> int:
        """One batch of due copies, written and committed; the chunks copied. `now`: every noted session is
        due (a test's or a script's deterministic write-behind, in the calling thread)."""
        with self.lock:
            staged = self._stage(now)
        if staged is None:
            return 0
        items, disk_slots, stage_slots = staged
        sums = self._write(items, disk_slots, stage_slots)
        with self.lock:
            return self._record(items, disk_slots, stage_slots, sums)

    def _candidates(self, s: Session, seen: set[int]) -> list[Item]:
        """The session's KV chunks on the device or the host without a valid copy (a shared chunk once)."""
        tags = identity_tags(s.token_ids, self.block_size)
        valid = self.copies.valid_in(s, tags)
        out = []
        for k, c in enumerate(s.chunks):
            if c.state in (DEVICE, HOST) and c.source is None and c.residue_block is None and k not in valid \
                    and id(c) not in seen and self.copies.of(c) is None:
                seen.add(id(c))
                out.append((s, k, c, tags[k]))
        return out

    def _stage(self, everything: bool = False) -> tuple[list[Item], list[int], list[int]] | None:
        """Phase 1 (lock held): the due sessions' chunks into staging slots and allocated disk slots."""
        now = time.monotonic()
        ready = [sid for sid, t in self._due.items() if t <= now or everything]
        for sid in ready:
            del self._due[sid]
        if not ready:
            return None
        self.copies.sweep(set(ready))
        if not self.state.usable(False):              # degraded and still failing: not now
            return None
        items: list[Item] = []
        seen: set[int] = set()
        for sid in ready:
            s = self.sessions.find(sid)
            if s is not None and not s.busy:           # busy: noted again when its turn ends
                items += self._candidates(s, seen)
        if not items:
            self.state.sync()
            return None
        pool = self.disk.pool
        if pool.limbo and len(items) > pool.num_free:
            self.state.sync(force=True)
        n = min(len(items), pool.num_free, self.staging.num_free)
        self.stats.skipped += len(items) - n
        if n < len(items) and self.staging.num_free < len(items):
            for sid in {s.session_id for s, *_ in items[n:]}:    # the queue was full: try again later
                self._due.setdefault(sid, now + self.delay)
        items = items[:n]
        if not items:
            return None
        disk_slots, stage_slots = pool.allocate(n), self.staging.allocate(n)
        self.copies.pending.update(disk_slots)
        for state in (DEVICE, HOST):
            idx = [i for i, (_, _, c, _) in enumerate(items) if c.state is state]
            if idx:
                self.transfer.copy_out(self.tiers.pool(state), [items[i][2].loc for i in idx], self.staging,
                                       [stage_slots[i] for i in idx])
        return items, disk_slots, stage_slots

    def _write(self, items: list[Item], disk_slots: list[int], stage_slots: list[int]) -> list[int] | None:
        """Phase 2 (no lock): the staged chunks into their disk slots, flushed; their checksums (None: the
        flush failed)."""
        self.transfer.settle(self.staging)               # the copies have landed in the staging pool
        f = self.disk.files["kv"]
        order = sorted(range(len(items)), key=lambda i: disk_slots[i])   # runs of slots: one pwrite each
        slots = [disk_slots[i] for i in order]
        src = torch.tensor([stage_slots[i] for i in order])
        try:
            for layer in range(self.staging.spec.num_layers):
                f.write(0, layer, slots, self.staging.data[layer].index_select(0, src))
            f.flush()
        except OSError:
            return None
        return [f.checksum(tag, slot) for (_, _, _, tag), slot in zip(items, disk_slots)]

    def _record(self, items: list[Item], disk_slots: list[int], stage_slots: list[int],
                sums: list[int] | None) -> int:
        """Phase 3 (lock held): unchanged chunks get their copy; then one commit. Returns the copies made."""
        pool, made = self.disk.pool, 0
        self.staging.free(stage_slots)
        self.copies.pending.difference_update(disk_slots)
        if sums is None:
            self.disk.failed("flush")
            pool.free_unnamed(disk_slots)
            self.stats.failed += len(items)
            return 0
        self.disk.failing.discard("flush")
        tags: dict[str, list[bytes]] = {}
        for (s, k, c, tag), slot, checksum in zip(items, disk_slots, sums):
            now = self.sessions.find(s.session_id)
            if now is s and k < len(s.chunks) and s.chunks[k] is c and c.state in (DEVICE, HOST) \
                    and self.copies.of(c) is None:
                if s.session_id not in tags:
                    tags[s.session_id] = identity_tags(s.token_ids, self.block_size)
                if k < len(tags[s.session_id]) and tags[s.session_id][k] == tag:
                    pool.checksums.set(slot, checksum, proven=True)
                    self.copies.add(DiskCopy(s.session_id, k, c, tag, slot))
                    self.state.mark_changed((s.session_id, *(c.entry.holders if c.entry is not None else ())))
                    made += 1
                    continue
            pool.free_unnamed([slot])
            self.stats.dropped += 1
        self.stats.written += made
        if self.state.sync():
            self.stats.batches += 1
        return made

    def stop(self) -> None:
        """Stop write-behind: the thread finishes its batch and exits (no lock held by the caller)."""
        self._stopped = True
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    # ---- the flush -----------------------------------------------------------------------------

    def flush(self, deadline: float) -> FlushReport | None:
        """Copy every idle session's device and host KV chunks without a valid copy to disk, most
        recently active sessions first, until `deadline` (time.monotonic()); commit; log what is left
        (lock held; the thread stopped or between batches). None once the tier is closed."""
        if self.disk.directory.index is None:
            return None
        t0, bs = time.monotonic(), self.block_size
        self.copies.sweep()
        if self.disk.pool.limbo:
            self.state.sync(force=True)               # limbo's slots are free once a commit forgot them
        seen: set[int] = set()
        items = [it for s in sorted(self.sessions, key=lambda s: -s.last_active) if not s.busy
                 for it in self._candidates(s, seen)]
        written = tokens = 0
        pool, i = self.disk.pool, 0
        while i < len(items) and pool.num_free > 0 and time.monotonic() < deadline:
            batch = items[i:i + min(FLUSH_BATCH, pool.num_free)]
            i += len(batch)
            try:
                made = self._flush_batch(batch)
            except StoreError:
                break
            written += made
            tokens += sum(s.chunk_len(k, bs) for s, k, c, _ in batch if self.copies.of(c) is not None)
        self.state.sync()
        left = [(s, k) for s, k, c, _ in items if self.copies.of(c) is None]
        report = FlushReport(written, tokens, len(left), sum(s.chunk_len(k, bs) for s, k in left),
                             time.monotonic() - t0)
        if left:
            log.warning("disk flush left %d chunks (%d tokens) of %d sessions unwritten (%s); they are recomputed "
                        "after a restart", report.chunks_left, report.tokens_left,
                        len({s.session_id for s, _ in left}),
                        "time budget spent" if time.monotonic() >= deadline else "disk tier full or failing")
        return report

    def _flush_batch(self, batch: list[Item]) -> int:
        """One batch of the flush: copied into free disk slots, flushed, recorded. StoreError: the flush failed."""
        pool = self.disk.pool
        slots = pool.allocate(len(batch))
        for state in (DEVICE, HOST):
            idx = [j for j, (_, _, c, _) in enumerate(batch) if c.state is state]
            if idx:
                self.transfer.copy(self.tiers.pool(state), [batch[j][2].loc for j in idx], pool,
                                   [slots[j] for j in idx])
        self.transfer.settle(pool)
        if not self.disk.write_done("kv", slots, [tag for *_, tag in batch]):
            raise StoreError("the disk tier could not flush its data file")
        for (s, k, c, tag), slot in zip(batch, slots):
            self.copies.add(DiskCopy(s.session_id, k, c, tag, slot))
            self.state.mark_changed((s.session_id, *(c.entry.holders if c.entry is not None else ())))
        return len(batch)
