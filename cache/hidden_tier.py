"""The hidden-state tier of the store (HCache): setup, per-step restore bookkeeping, integrity.
A mixin of SessionStore; every method runs with the store lock held."""

from __future__ import annotations

from .hidden import HiddenCapture, HiddenPool, HiddenRestore, HiddenSpec, Projector
from .session import Chunk, ChunkState
from .spec import capacity_in_blocks

HIDDEN_MODES = ("auto", "always", "never")


class HiddenTierMixin:
    # provided by SessionStore: device_pool, counters, _sessions

    def _init_hidden(self, mode: str, spec: HiddenSpec | None, capacity, host_capacity, project: Projector | None):
        """mode "never": no capture, no hidden tier. "always": capture while computing and keep chunks
        moving down from the device as hidden states. "auto": like "always" when a layer's hidden
        state is smaller than its K+V (MHA), else like "never" (GQA keeps KV)."""
        if mode not in HIDDEN_MODES:
            raise ValueError(f"hidden_states must be one of {HIDDEN_MODES}, got {mode!r}")
        self.hidden_mode, self.hidden_spec, self.project = mode, spec, project
        self.hidden_pool: HiddenPool | None = None
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

    def _new_restore(self) -> HiddenRestore | None:
        return None if self.capture is None else HiddenRestore(self.capture, self.project, self.counters)

    def _settle_restore(self, restore: HiddenRestore | None, ok: bool) -> None:
        """After a step: `ok` (the K/V of every layer was rebuilt) frees the hidden slots the blocks
        were rebuilt from; otherwise the chunks go back to HIDDEN and their blocks are freed."""
        if restore is None:
            return
        for sid, k, block, src in restore.chunks:
            s = self._sessions.get(sid)
            c = s.chunks[k] if s is not None and k < len(s.chunks) else None
            if c is None or c.state is not ChunkState.DEVICE or c.loc != block or c.source != src:
                continue       # the chunk was released meanwhile (its slots went with it)
            if ok:
                self.hidden_pool.free([src])
                c.source = None
            else:
                self.device_pool.free([block])
                s.chunks[k] = Chunk(ChunkState.HIDDEN, src)
                self.counters.restored_hidden -= s.chunk_len(k, self.block_size)
        restore.chunks = []

    def _hidden_used_bytes(self) -> int:
        pool = self.hidden_pool
        return 0 if pool is None else (pool.num_blocks - pool.num_free) * pool.hidden_spec.bytes_per_block
