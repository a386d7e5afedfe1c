"""Statistics of the store, as frozen dataclasses, and a summary a person can read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a flush wrote (chunks, tokens), what it left for recomputation after a restart, and its time."""

    chunks_written: int
    tokens_written: int
    chunks_left: int
    tokens_left: int
    seconds: float


@dataclass(slots=True)
class TurnStats:
    """What the last turn of a session cost (tokens)."""

    reused_tokens: int = 0         # history served from stored KV (any tier)
    reused_device: int = 0         #   of which already on the device (or still cached there)
    swapped_in_host: int = 0       #   of which copied up from the host tier
    swapped_in_disk: int = 0       #   of which copied up from the disk tier
    restored_hidden: int = 0       #   of which rebuilt from hidden states (projection per layer)
    computed_tokens: int = 0       # rows the model ran in the turn's steps (new tokens and recomputed history)
    recomputed_tokens: int = 0     # history recomputed because its KV had been dropped
    generated_tokens: int = 0
    truncated_tokens: int = 0      # history cut because the new prompt diverged from it


@dataclass(slots=True)
class Counters:
    """Cumulative token counts since the store was created. One record shared by the store's parts;
    each field has the writers named beside it (module of the part, docs/store.md)."""

    device_hits: int = 0          # history found on the device (incl. cached shadows): step_planner, swap_in
    swapped_in_host: int = 0      # host -> device: swap_in
    swapped_in_disk: int = 0      # disk -> device: swap_in
    swapped_out_host: int = 0     # device -> host (ahead of time or under pressure): placement, LayeredChunks
    swapped_out_disk: int = 0     # host/device -> disk: placement
    dropped: int = 0              # KV discarded, token ids kept: placement
    recomputed: int = 0           # dropped history computed again: step_planner
    swapped_out_hidden: int = 0   # device -> hidden states on the host (HCache): placement
    restored_hidden: int = 0      # hidden -> device K/V by projection: swap_in
    restored_hidden_disk: int = 0  #   of which read from hidden states on disk: swap_in
    restore_seconds: float = 0.0  # wall time spent rebuilding K/V from hidden states: HiddenRestore
    forgotten_sessions: int = 0   # idle sessions forgotten whole past max_sessions / session_ttl: history
    copied_on_write: int = 0      # kept tokens of shared chunks cut inside, copied to a private block: placement


@dataclass(frozen=True, slots=True)
class StoreStats:
    sessions: int
    device_tokens: int            # tokens whose KV is in device blocks
    host_tokens: int              # ... in host slots (device_cached_tokens of them also still on device)
    disk_tokens: int
    dropped_tokens: int           # tokens with only their ids kept
    device_cached_tokens: int     # host tokens whose device block is not reclaimed yet
    device_bytes: int             # bytes of device blocks in use (incl. cached shadows)
    host_bytes: int
    disk_bytes: int
    device_capacity_tokens: int
    host_capacity_tokens: int
    disk_capacity_tokens: int
    device_free_blocks: int
    block_size: int
    kv_bytes_per_token: int
    counters: Counters = field(default_factory=Counters)
    hidden_tokens: int = 0        # of host_tokens, kept as hidden states (their bytes are in host_bytes)
    hidden_bytes: int = 0         # of host_bytes, used by hidden chunks
    hidden_capacity_tokens: int = 0
    hidden_bytes_per_token: int = 0   # bytes a hidden chunk stores per token (0: no hidden tier)
    disk_hidden_tokens: int = 0   # of disk_tokens, kept as hidden states (their bytes are in disk_bytes)
    disk_hidden_bytes: int = 0    # of disk_bytes, used by hidden chunks
    disk_hidden_capacity_tokens: int = 0
    device_reserved_bytes: int = 0    # virtual layout: the reserved range (paged: the pool's bytes)
    device_committed_bytes: int = 0   # resident pages of it (a CPU pool commits pages as they are first written;
                                      # a paged pool on a GPU: all its bytes)
    host_reserved_bytes: int = 0      # host tier (K/V and hidden-state pools): their bytes
    host_committed_bytes: int = 0     # ... resident pages of them (unpinned: taken as used; pinned: all)
    device_pages_released: int = 0    # virtual layout: pages given back to the OS so far
    device_kept_bytes: int = 0        # virtual layout: committed pages of free blocks kept for reuse
    cost_profile: str | None = None   # the eviction policy's Cost(l) in use and its source; None: the policy has none
    device_blocks_prefetched: int = 0  # virtual layout: blocks mapped ahead by the background mapper
    layered_tokens: int = 0           # layerwise_kv: tokens of running requests kept per layer (host + shared device)
    disk_degraded: bool = False       # the disk tier could not make its last change durable (retried on moves)
    disk_write_failures: int = 0      # data flushes and index commits of the disk tier that failed
    disk_checksum_failures: int = 0   # disk chunks that were not what they named: dropped and recomputed
    # Prefix sharing (prefix/sharing.py): the *_tokens fields above are physical (a chunk held by several
    # sessions counts once); logical_tokens counts every session's stored tokens (a shared chunk once per
    # holder) and shared_tokens the tokens of chunks held by more than one session (once each).
    logical_tokens: int = 0
    shared_tokens: int = 0
    prefix_index_chunks: int = 0      # full chunks findable in the prefix index

    @property
    def bytes_per_token(self) -> dict[str, float]:
        """Bytes stored per token in each tier (used bytes / tokens; shadows count on the device)."""
        used = {"device": (self.device_bytes, self.device_tokens + self.device_cached_tokens),
                "host": (self.host_bytes, self.host_tokens), "disk": (self.disk_bytes, self.disk_tokens)}
        return {t: (b / n if n else 0.0) for t, (b, n) in used.items()}

    @property
    def hit_rate(self) -> float:
        """Share of history tokens steps needed that were served from stored KV rather than recomputed."""
        c = self.counters
        served = c.device_hits + c.swapped_in_host + c.swapped_in_disk + c.restored_hidden
        return served / (served + c.recomputed) if served + c.recomputed else 1.0


@dataclass(frozen=True, slots=True)
class SessionStats:
    session_id: str
    num_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    dropped_tokens: int
    busy: bool
    last_turn: TurnStats
    hidden_tokens: int = 0        # of host_tokens, kept as hidden states
    disk_hidden_tokens: int = 0   # of disk_tokens, kept as hidden states
    last_active: float = 0.0      # the store clock's time of its last activity
    expected_at: float = 0.0      # the store clock's time its next turn is expected by (`KVStore.expect`), or 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def summary(st: StoreStats) -> str:
    c = st.counters
    rows = [
        f"sessions: {st.sessions}   block: {st.block_size} tokens   KV: {st.kv_bytes_per_token} B/token",
        f"device : {st.device_tokens:>8} tokens {_mib(st.device_bytes):>12} of {st.device_capacity_tokens} tokens"
        f"  ({st.device_cached_tokens} more cached ahead of swap-out, {st.device_free_blocks} blocks free)",
        f"host   : {st.host_tokens:>8} tokens {_mib(st.host_bytes):>12} of {st.host_capacity_tokens} tokens"
        + (f"  ({st.hidden_tokens} as hidden states, {st.hidden_bytes_per_token} B/token vs KV "
           f"{st.kv_bytes_per_token}; hidden capacity {st.hidden_capacity_tokens})"
           if st.hidden_capacity_tokens else ""),
        f"disk   : {st.disk_tokens:>8} tokens {_mib(st.disk_bytes):>12} of {st.disk_capacity_tokens} tokens"
        + (f"  ({st.disk_hidden_tokens} as hidden states; hidden capacity {st.disk_hidden_capacity_tokens})"
           if st.disk_hidden_capacity_tokens else ""),
        f"dropped: {st.dropped_tokens:>8} tokens (ids only)"
        + (f"   disk: {'DEGRADED, ' if st.disk_degraded else ''}{st.disk_write_failures} write failures, "
           f"{st.disk_checksum_failures} checksum failures"
           if st.disk_degraded or st.disk_write_failures or st.disk_checksum_failures else ""),
        f"traffic: hits {c.device_hits}, in host {c.swapped_in_host}, in disk {c.swapped_in_disk}, "
        f"out host {c.swapped_out_host}, out disk {c.swapped_out_disk}, dropped {c.dropped}, "
        f"recomputed {c.recomputed}, out hidden {c.swapped_out_hidden}, restored from hidden {c.restored_hidden} "
        f"({c.restored_hidden_disk} from disk, {c.restore_seconds * 1e3:.1f} ms)   hit rate {st.hit_rate:.1%}",
    ]
    return "\n".join(rows)
