"""The hidden-state tier of the store (HCache): setup, per-step restore bookkeeping, the rules of
moving hidden chunks. A mixin of SessionStore; every method runs with the store lock held.

Hidden chunks live in the host hidden pool (HIDDEN) and, below it, in the disk tier's hidden file
(DISK_HIDDEN, same split, so moving between them is a copy of slots). Either restores to the
device the same way: read up layer by layer and projected (`HiddenRestore`)."""

from __future__ import annotations

from .hidden_states import HiddenCapture, HiddenPool, HiddenRestore, HiddenSpec, Projector
from .session import ChunkState, Session
from .spec import capacity_in_blocks

HIDDEN_MODES = ("auto", "always", "never")
DEVICE, HIDDEN, DISK, DISK_HIDDEN = ChunkState.DEVICE, ChunkState.HIDDEN, ChunkState.DISK, ChunkState.DISK_HIDDEN
HIDDEN_FORMS = (HIDDEN, DISK_HIDDEN)


class HiddenTierMixin:
    # provided by SessionStore: device_pool, disk, counters, _sessions, _disk_dirty, _pool()

    def _init_hidden(self, mode: str, spec: HiddenSpec | None, capacity, host_capacity, project: Projector | None,
                     disk_capacity=None):
        """mode "never": no capture, no hidden tier. "always": capture while computing and keep chunks
        moving down from the device as hidden states. "auto": like "always" when a layer's hidden
        state is smaller than its K+V (MHA), else like "never" (GQA keeps KV). With a disk tier,
        hidden chunks moving down from the host stay hidden states in its hidden file, which holds
        `disk_capacity` (tokens or a size)."""
        if mode not in HIDDEN_MODES:
            raise ValueError(f"hidden_states must be one of {HIDDEN_MODES}, got {mode!r}")
        self.hidden_mode, self.hidden_spec, self.project = mode, spec, project
        self.hidden_pool: HiddenPool | None = None
        self.disk_hidden_pool: HiddenPool | None = None
        self.capture: HiddenCapture | None = None
        self._hidden_down = False
        if mode == "never":
            return
        if spec is None or project is None:
            raise ValueError(f"hidden_states={mode!r} needs a HiddenSpec and a projector (hidden -> K/V)")
        if spec.kv != self.spec:
            raise ValueError("the HiddenSpec must describe the store's own KV geometry")
        if mode == "auto" and spec.hidden_size >= 2 * spec.kv.num_kv_heads * spec.kv.head_dim:
            return
        capacity = capacity if capacity is not None else host_capacity
        if capacity is None:
            raise ValueError(f"hidden_states={mode!r} needs room for hidden states: give hidden_capacity "
                             "(or host_capacity, which it defaults to)")
        self.hidden_pool = HiddenPool(spec, capacity_in_blocks(capacity, spec), "cpu",
                                      pin_memory=self.spec.device.type == "cuda")
        self.capture = HiddenCapture(spec, self.device_pool.num_blocks)
        self._hidden_down = True
        if self.disk is not None:
            self.disk.open_hidden(spec, capacity_in_blocks(disk_capacity or "1GiB", spec))
            self.disk_hidden_pool = self.disk.hidden_pool

    def _new_restore(self) -> HiddenRestore | None:
        return None if self.capture is None else HiddenRestore(self.capture, self.project, self.counters)

    def _settle_restore(self, restore: HiddenRestore | None, ok: bool) -> None:
        """After a step: `ok` (the K/V of every layer was rebuilt) frees the hidden slots the blocks
        were rebuilt from; otherwise the chunks go back to their hidden form and their blocks are freed."""
        if restore is None:
            return
        for (sid, k, source), block in restore.chunks:
            s = self._sessions.get(sid)
            c = s.chunks[k] if s is not None and k < len(s.chunks) else None
            if c is None or c.state is not ChunkState.DEVICE or c.loc != block or c.source != source:
                continue       # the chunk was released meanwhile (its slots went with it)
            state, slot = source
            self._disk_dirty |= state is DISK_HIDDEN
            if ok:
                self._pool(state).free([slot])
                c.source = None
            else:
                self.device_pool.free([block])
                c.assign(state, slot)
                n = s.chunk_len(k, self.block_size)
                self.counters.restored_hidden -= n
                self.counters.restored_hidden_disk -= n if state is DISK_HIDDEN else 0
        restore.chunks = []

    def _hidden_target(self, state: ChunkState, target: ChunkState) -> ChunkState:
        """Where `move(..., target)` puts a chunk in `state`: hidden chunks stay hidden states on disk,
        and disk hidden chunks come up to the host as hidden states."""
        if target is DISK and state in HIDDEN_FORMS:
            return DISK_HIDDEN
        return target

    def _check_hidden_move(self, s: Session, ks: list[int], target: ChunkState) -> None:
        """Refuse moves the hidden forms cannot make (ValueError, nothing moved)."""
        if target is HIDDEN:
            self._check_hidden_source([(s, k) for k in ks if s.chunks[k].state is DEVICE], DEVICE)
            if any(s.chunks[k].state not in (DEVICE, *HIDDEN_FORMS) for k in ks):
                raise ValueError(f"session {s.session_id!r}: only device chunks can become hidden (host and disk "
                                 "chunks keep K/V only; their hidden states are gone)")
        if target not in (DEVICE, DISK, HIDDEN, ChunkState.DROPPED) and \
                any(s.chunks[k].state in HIDDEN_FORMS for k in ks):
            raise ValueError(f"session {s.session_id!r}: hidden chunks move to the device (their K/V is rebuilt "
                             "there), to disk (as hidden states) or are dropped")

    def _hidden_used_bytes(self, pool: HiddenPool | None) -> int:
        return 0 if pool is None else (pool.num_blocks - pool.num_free) * pool.hidden_spec.bytes_per_block
