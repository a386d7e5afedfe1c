"""Statistics of a store, read from its parts: per session (`session_stats`) and in all
(`store_stats`; `stats.summary` formats it for a person). Read-only; the caller holds the store lock."""

from __future__ import annotations

from ..pools.tier_pools import TierPools
from ..sessions.session import ChunkState, Session, SessionTable
from .stats import Counters, SessionStats, StoreStats


def session_stats(s: Session, block_size: int) -> SessionStats:
    r = s.residency(block_size)
    return SessionStats(s.session_id, s.num_tokens, r["device"], r["host"] + r["hidden"],
                        r["disk"] + r["disk_hidden"], r["dropped"], s.busy, s.last_turn,
                        hidden_tokens=r["hidden"], disk_hidden_tokens=r["disk_hidden"], last_active=s.last_active,
                        expected_at=s.expected_at)


def store_stats(sessions: SessionTable, tiers: TierPools, counters: Counters) -> StoreStats:
    """Tokens per tier are physical: a chunk shared by several sessions counts once (its holders'
    tokens are `logical_tokens`; `prefix/sharing.py`). O(the device's shadows and what changed since the last
    read), not O(sessions held), O(a shared chunk's holders) nor O(tenants): the table's counts (every holder
    counting a shared chunk) less the shared chunks' extra holders, both kept by `TierUsage`."""
    device, host, disk = tiers.device, tiers.host, tiers.disk
    bs = device.spec.block_size
    totals = sessions.totals()
    tot = {t.value: totals.get(t, 0) for t in ChunkState}
    logical = sum(tot.values()) - tot[ChunkState.DROPPED.value]
    extra, shared = sessions.shared_tokens()
    for st, n in extra.items():
        tot[st.value] -= n
    cached = sum(s.chunk_len(k, bs) for s, k in sessions.shadow_chunks())
    used = tiers.used_bytes

    def cap(pool):
        return 0 if pool is None else pool.num_blocks * bs

    disk_pool = disk.pool if disk is not None else None
    hid, dhid = tiers.hidden, tiers.disk_hidden
    return StoreStats(
        sessions=sessions.live, device_tokens=tot["device"],
        host_tokens=tot["host"] + tot["hidden"],
        dropped_tokens=tot["dropped"], device_cached_tokens=cached,
        device_bytes=used(device), host_bytes=used(host) + used(hid), disk_bytes=used(disk_pool) + used(dhid),
        disk_tokens=tot["disk"] + tot["disk_hidden"],
        device_capacity_tokens=cap(device), host_capacity_tokens=cap(host) + cap(hid),
        disk_capacity_tokens=cap(disk_pool) + cap(dhid), device_free_blocks=device.num_free,
        block_size=bs, kv_bytes_per_token=device.spec.bytes_per_token,
        counters=Counters(**{f: getattr(counters, f) for f in Counters.__slots__}),
        layered_tokens=tot[ChunkState.LAYERED.value],
        disk_degraded=disk is not None and disk.degraded,
        disk_write_failures=0 if disk is None else disk.write_failures,
        disk_checksum_failures=0 if disk is None else disk.checksum_failures,
        hidden_tokens=tot["hidden"], hidden_bytes=used(hid), hidden_capacity_tokens=cap(hid),
        disk_hidden_tokens=tot["disk_hidden"], disk_hidden_bytes=used(dhid), disk_hidden_capacity_tokens=cap(dhid),
        hidden_bytes_per_token=0 if hid is None else hid.hidden_spec.bytes_per_token,
        device_reserved_bytes=device.bytes,
        device_committed_bytes=device.committed_bytes(),
        host_reserved_bytes=sum(p.reserved_bytes for p in (host, hid) if p is not None),
        host_committed_bytes=sum(p.committed_bytes() for p in (host, hid) if p is not None),
        device_pages_released=device.pages_released,
        device_kept_bytes=device.cached_bytes,
        device_blocks_prefetched=device.blocks_prefetched,
        logical_tokens=logical, shared_tokens=shared, prefix_index_chunks=len(tiers.sharing.index),
    )
