"""Integrity and statistics of the store (a mixin of SessionStore): read-only, under the store lock."""

from __future__ import annotations

from .session import ChunkState
from .stats import Counters, SessionStats, StoreStats, summary
from .tiering import DEVICE, DISK, DISK_HIDDEN, DROPPED, HIDDEN, HOST, LAYERED, SHADOWED


class AuditMixin:
    # provided by SessionStore: _lock, _sessions, session(), pools, spec, counters, layout

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot of every tier is free or owned by exactly one chunk,
        chunk tables match token counts, and only HOST/HIDDEN chunks have shadows. A device block
        shared by LAYERED chunks (layerwise_kv) is owned per residue by distinct chunks, each naming
        the block's factor, and by nothing else."""
        with self._lock:
            owners: dict[ChunkState, dict[int, tuple[str, int]]] = {
                DEVICE: {}, HOST: {}, HIDDEN: {}, DISK: {}, DISK_HIDDEN: {}}

            def own(tier, slot, who):
                pool = self._pool(tier)
                assert pool is not None, f"{who} is {tier.value} but the store has no such tier"
                assert 0 <= slot < pool.num_blocks, f"{who}: {tier.value} slot {slot} out of range"
                assert slot not in owners[tier], f"{tier.value} slot {slot} owned by {owners[tier][slot]} and {who}"
                owners[tier][slot] = who

            shared: dict[tuple[int, int], tuple[tuple[str, int], int]] = {}   # (block, residue) -> (who, factor)
            seen: set[int] = set()        # chunk objects counted (a prefix-shared chunk is one object)
            for s in self._sessions.values():
                n_chunks = -(-len(s.token_ids) // self.block_size)
                assert len(s.chunks) == n_chunks, (
                    f"{s.session_id}: {len(s.chunks)} chunks for {len(s.token_ids)} tokens")
                for k, c in enumerate(s.chunks):
                    who = (s.session_id, k)
                    if id(c) in seen:
                        assert c.entry is not None, f"{who}: a chunk object in two places that is not shared"
                        continue
                    seen.add(id(c))
                    if c.state is DROPPED:
                        assert c.loc is None and c.shadow is None, (who, c)
                    else:
                        assert c.loc is not None, (who, c)
                        own(HOST if c.state is LAYERED else c.state, c.loc, who)
                    if c.share is not None:
                        assert c.state is LAYERED, f"{who}: only layered chunks hold a device share, {c}"
                        block, factor, residue = c.share
                        assert 0 <= residue < factor, (who, c)
                        assert (block, residue) not in shared, f"residue {residue} of block {block} owned twice"
                        shared[block, residue] = (who, factor)
                    if c.shadow is not None:
                        assert c.state in SHADOWED, f"{who}: only host/hidden chunks keep a device shadow, {c}"
                        own(DEVICE, c.shadow, who)
                    if c.source is not None:
                        assert c.state is DEVICE, f"{who}: only device chunks are rebuilt from a hidden slot, {c}"
                        assert c.source[0] in (HIDDEN, DISK_HIDDEN), f"{who}: not a hidden form {c}"
                        own(c.source[0], c.source[1], who)
            listed = set()
            for block, (factor, slots) in self.shares.blocks.items():
                assert any(o is not None for o in slots), f"shared block {block} has no owner and is not freed"
                for r, o in enumerate(slots):
                    if o is not None:
                        assert shared.get((block, r)) == (o, factor), (
                            f"shared block {block} residue {r}: table says {o} (factor {factor}), "
                            f"chunks say {shared.get((block, r))}")
                        listed.add((block, r))
                own(DEVICE, block, ("shared", block))
            assert listed == set(shared), f"shares not in the table: {sorted(set(shared) - listed)[:4]}"
            self.sharing.check(list(self._sessions.values()))
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
                return SessionStats(session_id, s.num_tokens, r["device"], r["host"] + r["hidden"],
                                    r["disk"] + r["disk_hidden"], r["dropped"], s.busy, s.last_turn,
                                    hidden_tokens=r["hidden"], disk_hidden_tokens=r["disk_hidden"])
            tot = {t.value: 0 for t in ChunkState}          # physical: a shared chunk once
            cached = 0
            for s, k, c in self.sharing.physical(self._sessions.values()):
                tot[c.state.value] += s.chunk_len(k, bs)
                cached += s.chunk_len(k, bs) if c.shadow is not None else 0
            logical, shared_tokens = self.sharing.stats(self._sessions.values())
            per_block = self.spec.bytes_per_block

            def used(pool):
                return 0 if pool is None else (pool.num_blocks - pool.num_free) * per_block

            def cap(pool):
                return 0 if pool is None else pool.num_blocks * bs

            disk_pool = self.disk.pool if self.disk is not None else None
            hid, dhid = self.hidden_pool, self.disk_hidden_pool
            return StoreStats(
                sessions=sum(not s.retained for s in self._sessions.values()), device_tokens=tot["device"],
                host_tokens=tot["host"] + tot["hidden"],
                dropped_tokens=tot["dropped"], device_cached_tokens=cached,
                device_bytes=used(self.device_pool), host_bytes=used(self.host_pool) + self._hidden_used_bytes(hid),
                disk_bytes=used(disk_pool) + self._hidden_used_bytes(dhid),
                disk_tokens=tot["disk"] + tot["disk_hidden"],
                device_capacity_tokens=cap(self.device_pool), host_capacity_tokens=cap(self.host_pool) + cap(hid),
                disk_capacity_tokens=cap(disk_pool) + cap(dhid), device_free_blocks=self.device_pool.num_free,
                block_size=bs, kv_bytes_per_token=self.spec.bytes_per_token,
                counters=Counters(**{f: getattr(self.counters, f) for f in Counters.__slots__}),
                layered_tokens=tot[LAYERED.value],
                disk_degraded=self.disk is not None and self.disk.degraded,
                disk_write_failures=0 if self.disk is None else self.disk.write_failures,
                disk_checksum_failures=0 if self.disk is None else self.disk.checksum_failures,
                hidden_tokens=tot["hidden"], hidden_bytes=self._hidden_used_bytes(hid), hidden_capacity_tokens=cap(hid),
                disk_hidden_tokens=tot["disk_hidden"], disk_hidden_bytes=self._hidden_used_bytes(dhid),
                disk_hidden_capacity_tokens=cap(dhid),
                hidden_bytes_per_token=0 if hid is None else hid.hidden_spec.bytes_per_token,
                device_reserved_bytes=self.device_pool.bytes,
                device_committed_bytes=self.device_pool.committed_bytes(),
                host_reserved_bytes=sum(p.reserved_bytes for p in (self.host_pool, hid) if p is not None),
                host_committed_bytes=sum(p.committed_bytes() for p in (self.host_pool, hid) if p is not None),
                device_pages_released=getattr(self.device_pool, "pages_released", 0),
                device_kept_bytes=getattr(self.device_pool, "cached_bytes", 0),
                device_blocks_prefetched=getattr(self.device_pool, "blocks_prefetched", 0),
                logical_tokens=logical, shared_tokens=shared_tokens, prefix_index_chunks=len(self.sharing.index),
            )

    def summary(self) -> str:
        """The store's tiers and traffic, for a person."""
        return summary(self.stats())

