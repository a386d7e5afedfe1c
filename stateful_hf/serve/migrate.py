"""Export one session's KV from a store and import it into another (KV migration between replicas).

The store stays the one owner of KV state; this module only uses its public operations:
- export: `store.lease(sid)` (the session is busy, so no turn, hint or eviction touches it), then
  copy each stored chunk's block out of the pool of its tier (device, host or disk). Chunks whose
  K/V is nowhere (dropped; hidden states that could not be projected back first) are left out:
  the importer marks them dropped and the next turn recomputes them, as it would have on the holder.
- import: `store.lease(sid)`, then `store.plan_step` over the whole history (the store allocates
  device blocks and appends the token ids, exactly as for a prefill), the exported blocks are
  written into those blocks instead of running a forward, and `store.commit`. The session lands
  on the device: its fastest tier. Left-out chunks are then moved to "dropped".

Between the import's lease and the final `move(..., "dropped")` a turn must not start on the session:
the caller (`Replica`) holds the session's gate for the whole import.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

import torch

from ..cache import ChunkState, SessionBusyError

_TIMEOUT = 30.0


@dataclass
class SessionExport:
    """One session's history and stored KV. `kv[i]` is chunk `chunks[i]`'s block,
    [layers, 2, block_size, kv_heads, head_dim] on the CPU."""

    session_id: str
    token_ids: list[int]
    block_size: int
    geometry: tuple
    chunks: list[int]
    kv: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_tokens(self) -> int:
        n, bs = len(self.token_ids), self.block_size
        return sum(min(bs, n - k * bs) for k in self.chunks)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def save(self, path) -> None:
        """Write to a file (safetensors): a transfer through a shared directory."""
        from safetensors.torch import save_file
        meta = {"session_id": self.session_id, "token_ids": self.token_ids, "block_size": self.block_size,
                "geometry": list(self.geometry), "chunks": self.chunks}
        save_file({"kv": self.kv.contiguous()}, str(path), metadata={"export": json.dumps(meta)})

    @classmethod
    def load(cls, path) -> SessionExport:
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["export"])
            kv = f.get_tensor("kv")
        return cls(meta["session_id"], meta["token_ids"], meta["block_size"], tuple(meta["geometry"]),
                   meta["chunks"], kv)


def geometry(store) -> tuple:
    sp = store.spec
    return (sp.num_layers, sp.num_kv_heads, sp.head_dim, str(sp.dtype).removeprefix("torch."))


def _lease(store, session_id: str, timeout: float):
    """Enter the session's lease, waiting while a turn holds it."""
    deadline = time.monotonic() + timeout
    while True:
        lease = store.lease(session_id)
        try:
            lease.__enter__()
            return lease
        except SessionBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def export_session(store, session_id: str, timeout: float = _TIMEOUT) -> SessionExport:
    """Copy out the session's token ids and every chunk whose K/V is stored (any tier)."""
    s = store.session(session_id)
    hidden = [k for k, c in enumerate(s.chunks) if c.state in (ChunkState.HIDDEN, ChunkState.DISK_HIDDEN)]
    if hidden:                       # hidden states -> K/V on the device (projection), best effort
        with contextlib.suppress(Exception):   # if not: left out below, recomputed by the next turn
            store.move(session_id, hidden, "device")
    lease = _lease(store, session_id, timeout)
    try:
        store.transfer.synchronize()                   # no copy into a slot we read is in flight
        store.missing_positions(session_id)            # disk chunks are proven before they are read
        pools = {ChunkState.DEVICE: store.device_pool, ChunkState.HOST: store.host_pool,
                 ChunkState.DISK: store.disk.pool if store.disk is not None else None}
        chunks, blocks = [], []
        for k, c in enumerate(s.chunks):
            pool = pools.get(c.state)
            if pool is None:
                continue
            chunks.append(k)
            blocks.append(pool.data[:, c.loc].to("cpu", copy=True))
        spec = store.spec
        kv = torch.stack(blocks) if blocks else torch.empty(
            (0, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
        return SessionExport(session_id, list(s.token_ids), store.block_size, geometry(store), chunks, kv)
    finally:
        lease.__exit__(None, None, None)


def import_session(store, exp: SessionExport, timeout: float = _TIMEOUT) -> int:
    """Make `exp` the store's session `exp.session_id` (replacing any older copy), its stored chunks
    on the device. Returns the tokens whose KV was imported."""
    if exp.block_size != store.block_size or tuple(exp.geometry) != geometry(store):
        raise ValueError(f"session {exp.session_id!r}: exported KV has geometry {exp.geometry} / block "
                         f"{exp.block_size}, this store {geometry(store)} / block {store.block_size}")
    sid, n = exp.session_id, len(exp.token_ids)
    if sid in store:
        deadline = time.monotonic() + timeout
        while True:
            try:
                store.delete(sid)
                break
            except SessionBusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
    if not n:
        return 0
    store.open(sid)
    lease = _lease(store, sid, timeout)
    try:
        step = store.plan_step([(sid, exp.token_ids, list(range(n)))])
        try:
            s, pool = store.session(sid), store.device_pool
            capture = getattr(store, "capture", None)
            for i, k in enumerate(exp.chunks):
                pool.data[:, s.chunks[k].loc].copy_(exp.kv[i])
            if capture is not None:           # no hidden states came with the KV
                for c in s.chunks:
                    capture.valid[c.loc] = False
            store.commit(step)
        except BaseException:
            store.abort(step)
            raise
    except BaseException:
        lease.__exit__(None, None, None)
        if sid in store:
            store.delete(sid)
        raise
    lease.__exit__(None, None, None)
    absent = sorted(set(range(-(-n // store.block_size))) - set(exp.chunks))
    if absent:
        store.move(sid, absent, "dropped")
    return exp.kv_tokens
