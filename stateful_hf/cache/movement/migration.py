"""One session's history and stored KV out of a store and into another (`SessionExport`): KV
migration between replicas, and filling a store from one prefilled session.

- export (`KVStore.export_session`): the session must be idle (SessionBusyError otherwise: no turn,
  hint or eviction is touching it). Hidden chunks are first projected back to K/V on the device,
  best effort; disk chunks are proven before they are read; then every chunk whose K/V is stored
  (device, host or disk) is copied out through the transfer engine (`Transfer.read_out`). Chunks
  whose K/V is nowhere are left out: the importer marks them dropped and the next turn recomputes
  them, as it would have on the holder.
- import (`KVStore.import_session`): any older copy of the session is deleted; the session is
  leased, one step is planned over its whole history (device blocks allocated, token ids appended,
  exactly as for a prefill), the exported blocks are written into those blocks instead of running a
  forward (`Transfer.write_in`) and the step is committed; left-out chunks then become dropped. The
  session lands on the device, its fastest tier. A failure deletes the half-imported session.

Both run with the store lock held, through the store's parts; nothing else reads or writes pool data.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...kernels.blocks import blocks_for
from ..errors import CapacityError, SessionBusyError, StoreError
from ..sessions.session import HIDDEN_FORMS, Chunk, ChunkState, Session
from ..spec import KVSpec

if TYPE_CHECKING:
    from ..store_parts import StoreParts

STORED = (ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK)    # K/V in a block of one of these pools


@dataclass(frozen=True)
class SessionExport:
    """One session's history and stored KV. `kv[i]` is chunk `chunks[i]`'s block,
    [layers, 2, block_size, kv_heads, head_dim] on the CPU."""

    session_id: str
    token_ids: list[int]
    block_size: int
    geometry: tuple             # (layers, kv_heads, head_dim, dtype name): `geometry(spec)`
    chunks: list[int]           # ascending chunk indices whose K/V came along
    kv: torch.Tensor            # [len(chunks), layers, 2, block_size, kv_heads, head_dim]

    def __post_init__(self) -> None:
        assert self.kv.shape[0] == len(self.chunks), (self.kv.shape, len(self.chunks))
        assert self.chunks == sorted(set(self.chunks)), self.chunks
        assert all(0 <= k < blocks_for(len(self.token_ids), self.block_size) for k in self.chunks), self.chunks

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


def geometry(spec: KVSpec) -> tuple:
    return (spec.num_layers, spec.num_kv_heads, spec.head_dim, str(spec.dtype).removeprefix("torch."))


def export_session(p: StoreParts, spec: KVSpec, s: Session) -> SessionExport:
    """`KVStore.export_session`. Mutates: hidden chunks' tier (projected to the device, best effort)."""
    if s.busy:
        raise SessionBusyError(s.session_id)
    hidden = [k for k, c in enumerate(s.chunks) if c.state in HIDDEN_FORMS]
    if hidden:                                 # if not possible: left out below, recomputed by the next turn
        with contextlib.suppress(Exception), p.placement.moving("explicit"):
            p.relocation.move(s, hidden, ChunkState.DEVICE)
    p.placement.prove(s)                       # disk chunks are proven (or dropped) before they are read
    chunks = [k for k, c in enumerate(s.chunks) if c.state in STORED]
    kv = torch.empty((len(chunks), spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim),
                     dtype=spec.dtype)
    for state in STORED:
        rows = [i for i, k in enumerate(chunks) if s.chunks[k].state is state]
        if rows:
            kv[rows] = p.transfer.read_out(p.tiers.pool(state), [s.chunks[chunks[i]].loc for i in rows])
    return SessionExport(s.session_id, list(s.token_ids), spec.block_size, geometry(spec), chunks, kv)


def import_session(p: StoreParts, spec: KVSpec, exp: SessionExport) -> int:
    """`KVStore.import_session`: the tokens whose KV was imported. Mutates: the session (replaced)."""
    _check(exp, spec)
    sid, n = exp.session_id, len(exp.token_ids)
    old = p.sessions.find(sid)
    if old is not None:
        p.history.delete(old, keep_shared=False)        # SessionBusyError while a turn holds it
    if not n:
        return 0
    s = p.sessions.open(sid)
    p.sessions.acquire(sid)
    try:
        step = p.planner.plan([(sid, exp.token_ids, list(range(n)))], None)
        try:
            p.transfer.write_in(p.tiers.device, [s.chunks[k].loc for k in exp.chunks], exp.kv)
            for c in s.chunks:                            # no hidden states came with the KV
                p.hidden.computed(c.loc, captured=False)
            p.planner.commit(step)
        except BaseException:
            p.planner.abort(step)
            raise
    except BaseException:
        p.sessions.release(s)
        p.history.delete(s, keep_shared=False)
        raise
    p.sessions.release(s)
    absent = sorted(set(range(blocks_for(n, spec.block_size))) - set(exp.chunks))
    if absent:
        with p.placement.moving("explicit"):
            p.relocation.move(s, absent, ChunkState.DROPPED)
    return exp.kv_tokens


def import_sessions(p: StoreParts, spec: KVSpec, exps: Iterable[SessionExport], target: ChunkState | None) -> int:
    """`KVStore.import_sessions` (the caller maintains after). Into HOST or DISK: straight into that tier's
    slots, `IMPORT_BATCH` sessions at a time (`_import_into`: one disk flush each); otherwise
    `import_session` each, then moved to `target`. A bad export raises after those before it are in."""
    n, batch = 0, []
    direct = target in (ChunkState.HOST, ChunkState.DISK) and p.tiers.pool(target) is not None
    for exp in exps:
        if not direct:
            n += import_session(p, spec, exp)
            s = p.sessions.find(exp.session_id)
            if target is not None and s is not None:
                with p.placement.moving("explicit"):
                    p.relocation.move(s, list(range(len(s.chunks))), target)
            continue
        try:
            _check(exp, spec)
        except ValueError:                     # the batch before it goes in first
            if batch:
                _import_batch(p, spec, batch, target)
            raise
        batch.append(exp)
        if len(batch) == IMPORT_BATCH:
            n, batch = n + _import_batch(p, spec, batch, target), []
    return n + (_import_batch(p, spec, batch, target) if batch else 0)


IMPORT_BATCH = 1024      # sessions per disk flush of a bulk import


def _import_batch(p: StoreParts, spec: KVSpec, exps: list[SessionExport], target: ChunkState) -> int:
    """`_import_into` the batch; if the tier cannot hold it whole, one session at a time (each making
    room by the policy, so that later ones may push earlier ones down, as separate imports would)."""
    try:
        return _import_into(p, spec, exps, target)
    except CapacityError:
        if len(exps) == 1:
            raise
        return sum(_import_into(p, spec, [exp], target) for exp in exps)


def _check(exp: SessionExport, spec: KVSpec) -> None:
    if exp.block_size != spec.block_size or tuple(exp.geometry) != geometry(spec):
        raise ValueError(f"session {exp.session_id!r}: exported KV has geometry {tuple(exp.geometry)} / block "
                         f"{exp.block_size}, this store {geometry(spec)} / block {spec.block_size}")


def _import_into(p: StoreParts, spec: KVSpec, exps: list[SessionExport], target: ChunkState) -> int:
    """Sessions (replacing any of the same ids) whose exported chunks are written into new slots of the
    HOST or DISK tier (made durable before any chunk names them), the rest DROPPED. On any failure
    the batch's sessions are deleted. Mutates: those sessions, the target pool (room made by the policy)."""
    if target is ChunkState.DISK:              # as a move to disk: a degraded tier retries its commit first
        p.disk_state.usable(strict=True)       # StoreError (nothing changed) if it still fails
    exps = list({exp.session_id: exp for exp in exps}.values())      # the last export of an id wins
    bs, made, slots, pool = spec.block_size, [], [], p.tiers.pool(target)
    try:
        for exp in exps:
            old = p.sessions.find(exp.session_id)
            if old is not None:
                p.history.delete(old, keep_shared=False)        # SessionBusyError while a turn holds it
            if not exp.token_ids:
                continue
            s = p.sessions.open(exp.session_id)
            p.sessions.acquire(exp.session_id)                  # busy: nothing moves or reads it meanwhile
            made.append((s, exp))
            s.token_ids.extend(exp.token_ids)
            s.chunks.extend(Chunk() for _ in range(blocks_for(len(exp.token_ids), bs)))    # DROPPED until written
        items = [(s, k) for s, exp in made for k in exp.chunks]
        slots = p.placement.take(target, len(items), {s.session_id for s, _ in made})
        if items:
            p.transfer.write_in(pool, slots, torch.cat([exp.kv for _, exp in made]))
        if target is ChunkState.DISK and items and not p.disk_state.written(items, target, slots):
            slots = []                         # freed by the failed flush
            raise StoreError(f"the disk tier {str(p.tiers.disk.dir)!r} could not flush its data file; the "
                             f"{len(made)} sessions of this import were not made")
    except BaseException:
        if slots and target is ChunkState.DISK:      # named by no chunk yet, nor by a committed index
            pool.free_unnamed(slots)
        elif slots:
            pool.free(slots)
        for s, _ in made:
            p.sessions.release(s)
            p.history.delete(s, keep_shared=False)
        raise
    for (s, k), slot in zip(items, slots):
        s.chunks[k] = Chunk(target, slot)
    for s, _ in made:
        p.sessions.release(s)                  # marks it: its tier's order, counts, the disk index's rows
    return sum(exp.kv_tokens for _, exp in made)
