"""The metrics of one replica, with prometheus_client, in a registry of its own.

Two kinds of series:
- per request, observed here when a turn ends (`ReplicaMetrics.finished`): vLLM-style latency
  histograms, token counters, hints and migrations; and per move batch the restore time
  (`ReplicaMetrics.moved`, a listener on the store's move ledger);
- read at scrape time from their one owner (`StoreCollector`): the store's statistics
  (`store.stats()`: tiers, counters), its move ledger (`store.moves`) and the engine's statistics
  (queue depth). Nothing is copied into a second counter.

Adding a field of the store's statistics to /metrics is one line in `STORE_GAUGES` (a `StoreStats`
field) or `STORE_COUNTERS` (a `Counters` field); a test fails while a `Counters` field is in neither
`STORE_COUNTERS` nor `UNEXPORTED_COUNTERS`. The replica label is added by the router (`exposition.merge`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .exposition import families

if TYPE_CHECKING:
    from ..cache.doors.server import ServerStore

PREFIX = "stateful_hf"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
RESTORE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
TIERS = ("device", "host", "disk")

# name (without the _total a counter's samples get) -> (help, label names)
COUNTERS = {
    "requests": ("Finished requests, by finish reason", ("finish_reason",)),
    "prompt_tokens": ("Prompt (conversation) tokens of finished requests", ()),
    "reused_tokens": ("History tokens served from stored KV (any tier) instead of being computed", ()),
    "swapped_tokens": ("Of the reused tokens, those brought up from a lower tier (host, disk, hidden states)", ()),
    "recomputed_tokens": ("History tokens recomputed because their KV had been dropped or evicted", ()),
    "generation_tokens": ("Generated tokens", ()),
    "turns_with_reuse": ("Finished requests that reused stored KV", ()),
    "hints": ("Hints (advisory requests) received", ()),
    "hints_finished": ("Hints whose prefetch ended, by outcome (done, busy: the request came first, no room, ...)",
                       ("outcome",)),
    "hint_prefetched_tokens": ("Tokens moved up to the device by finished hints", ()),
    "migrations_in": ("Sessions imported from another replica", ()),
    "migrations_out": ("Sessions exported to another replica", ()),
    "migrated_tokens": ("Tokens whose KV was imported from another replica", ()),
    "migration_seconds": ("Wall time spent importing sessions", ()),
}
# name -> (help, buckets, label names)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Arrival to first generated token", LATENCY_BUCKETS, ()),
    "time_per_output_token_seconds": ("Mean time per output token after the first", LATENCY_BUCKETS, ()),
    "e2e_request_latency_seconds": ("Arrival to last token", LATENCY_BUCKETS, ()),
    "request_queue_time_seconds": ("Arrival to first scheduled in a step", LATENCY_BUCKETS, ()),
    "turn_recomputed_tokens": ("History tokens one turn recomputed", TOKEN_BUCKETS, ()),
    "turn_reused_tokens": ("History tokens one turn reused from stored KV", TOKEN_BUCKETS, ()),
    "restore_seconds": ("Wall time of one batch of chunks copied up to the device, by source tier (hidden "
                        "states: 0 here, their rebuild is in store_hidden_restore_seconds_total)",
                        RESTORE_BUCKETS, ("tier",)),
}


def _tiers(key: str) -> Callable:
    """Per-tier values of StoreStats fields `{tier}_{key}`, for the tiers that report one."""
    return lambda st: [((t,), getattr(st, f"{t}_{key}")) for t in TIERS if hasattr(st, f"{t}_{key}")]


def _one(field: str) -> Callable:
    return lambda st: [((), getattr(st, field))]


# Gauges read from StoreStats at scrape time: name -> (help, label names, st -> [(label values, value)])
STORE_GAUGES = {
    "sessions": ("Sessions in the store", (), _one("sessions")),
    "tier_tokens": ("Tokens whose KV is in a tier (host and disk include hidden-state chunks)", ("tier",),
                    _tiers("tokens")),
    "tier_bytes": ("Bytes of a tier's slots in use", ("tier",), _tiers("bytes")),
    "tier_capacity_tokens": ("Capacity of a tier in tokens", ("tier",), _tiers("capacity_tokens")),
    "tier_reserved_bytes": ("Bytes a tier has reserved (address range or preallocated pool)", ("tier",),
                            _tiers("reserved_bytes")),
    "tier_committed_bytes": ("Bytes of a tier backed by memory now", ("tier",), _tiers("committed_bytes")),
    "tier_hidden_tokens": ("Tokens of a tier kept as hidden states (HCache)", ("tier",),
                           lambda st: [(("host",), st.hidden_tokens), (("disk",), st.disk_hidden_tokens)]),
    "tier_hidden_bytes": ("Bytes of a tier used by hidden states", ("tier",),
                          lambda st: [(("host",), st.hidden_bytes), (("disk",), st.disk_hidden_bytes)]),
    "dropped_tokens": ("Tokens with only their ids kept (recomputed when needed)", (), _one("dropped_tokens")),
    "device_cached_tokens": ("Host tokens whose device block is not reclaimed yet (lazy reclamation)", (),
                             _one("device_cached_tokens")),
    "device_free_blocks": ("Free device blocks", (), _one("device_free_blocks")),
    "layered_tokens": ("Tokens of running requests kept per layer (layer-wise KV)", (), _one("layered_tokens")),
    "kv_hit_rate": ("Share of needed history tokens served from stored KV", (), lambda st: [((), st.hit_rate)]),
    "disk_degraded": ("1 while the disk tier cannot make changes durable (no new writes; retried on moves)", (),
                      lambda st: [((), float(st.disk_degraded))]),
}
# StoreStats fields that only grow: field -> (name without _total, help)
STORE_STAT_COUNTERS = {
    "disk_write_failures": ("store_disk_write_failures", "Disk tier data flushes and index commits that failed"),
    "disk_checksum_failures": ("store_disk_checksum_failures",
                               "Disk chunks that were not what they named: dropped and recomputed"),
}
# Counters fields exported: field -> (name without _total, help)
STORE_COUNTERS = {
    "device_hits": ("store_device_hits_tokens", "History tokens a step found on the device"),
    "swapped_in_host": ("store_swapped_in_host_tokens", "Tokens copied host -> device"),
    "swapped_in_disk": ("store_swapped_in_disk_tokens", "Tokens copied disk -> device"),
    "swapped_out_host": ("store_swapped_out_host_tokens", "Tokens copied device -> host"),
    "swapped_out_disk": ("store_swapped_out_disk_tokens", "Tokens copied to disk"),
    "dropped": ("store_dropped_tokens", "Tokens whose KV was discarded (ids kept)"),
    "recomputed": ("store_recomputed_tokens", "Dropped history tokens computed again"),
    "swapped_out_hidden": ("store_swapped_out_hidden_tokens", "Tokens kept as hidden states instead of KV"),
    "restored_hidden": ("store_restored_hidden_tokens", "Tokens whose K/V was rebuilt from hidden states"),
    "restored_hidden_disk": ("store_restored_hidden_disk_tokens", "Of those, read from hidden states on disk"),
    "restore_seconds": ("store_hidden_restore_seconds", "Wall time spent rebuilding K/V from hidden states"),
    "forgotten_sessions": ("store_forgotten_sessions", "Idle sessions forgotten whole past max_sessions / session_ttl"),
    "copied_on_write": ("store_copied_on_write_tokens", "Kept tokens of shared chunks cut inside, copied instead of "
                        "recomputed"),
}
UNEXPORTED_COUNTERS: frozenset[str] = frozenset()      # Counters fields deliberately left out of /metrics
# Move ledger totals (store.moves): name -> (MoveTotals field, help); labels src, dst, reason
MOVES = {
    "tier_move_batches": ("batches", "Move batches between tiers"),
    "tier_move_chunks": ("chunks", "Chunks moved between tiers (eviction decisions: reason pressure/ahead/slots)"),
    "tier_move_tokens": ("tokens", "Tokens moved between tiers"),
    "tier_move_bytes": ("bytes", "Bytes written to the target tier by moves (0 for drops)"),
    "tier_move_seconds": ("seconds", "Wall time spent issuing the copies of moves"),
}


class StoreCollector:
    """Reads the store's and engine's statistics at each scrape."""

    def __init__(self, store: ServerStore, engine=None):
        self.store, self.engine = store, engine

    def collect(self):
        st = self.store.stats()
        for name, (help_, labels, get) in STORE_GAUGES.items():
            g = GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=list(labels))
            for values, v in get(st):
                g.add_metric(list(values), float(v))
            yield g
        for field, (name, help_) in STORE_COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_, value=float(getattr(st.counters, field)))
        for field, (name, help_) in STORE_STAT_COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_, value=float(getattr(st, field)))
        totals = self.store.moves.snapshot()
        for name, (field, help_) in MOVES.items():
            c = CounterMetricFamily(f"{PREFIX}_{name}", help_, labels=["src", "dst", "reason"])
            for key, t in sorted(totals.items()):
                c.add_metric(list(key), float(getattr(t, field)))
            yield c
        info = GaugeMetricFamily(f"{PREFIX}_eviction_policy_info", "The store's eviction policy (value 1)",
                                 labels=["policy"])
        info.add_metric([self.store.policy.name], 1.0)
        yield info
        if self.engine is not None:
            es = self.engine.stats()
            yield GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests running in the engine", value=es.running)
            yield GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests queued in the engine (queue depth)",
                                    value=es.waiting)
            yield CounterMetricFamily(f"{PREFIX}_engine_steps", "Engine steps (forward passes)", value=es.steps)
            yield CounterMetricFamily(f"{PREFIX}_engine_busy_seconds", "Time the engine spent in steps",
                                      value=es.busy_seconds)


class ReplicaMetrics:
    """The request-level series of one replica and the store collector, in one registry. Thread-safe
    (prometheus_client's metrics are)."""

    def __init__(self, store: ServerStore | None = None, engine=None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = {n: Counter(f"{PREFIX}_{n}", h, labelnames=labels, registry=self.registry)
                         for n, (h, labels) in COUNTERS.items()}
        self.histograms = {n: Histogram(f"{PREFIX}_{n}", h, labelnames=labels, buckets=b, registry=self.registry)
                           for n, (h, b, labels) in HISTOGRAMS.items()}
        if store is not None:
            self.registry.register(StoreCollector(store, engine))

    def inc(self, name: str, value: float = 1, **labels) -> None:
        """`name` with or without its _total suffix."""
        c = self.counters[name.removesuffix("_total")]
        (c.labels(**labels) if labels else c).inc(value)

    def observe(self, name: str, value: float | None, **labels) -> None:
        if value is not None:
            h = self.histograms[name]
            (h.labels(**labels) if labels else h).observe(value)

    def finished(self, out) -> None:
        """Account one finished RequestOutput."""
        m = out.metrics
        self.inc("requests", finish_reason=out.finish_reason or "unknown")
        self.inc("prompt_tokens", m.prompt_tokens)
        self.inc("reused_tokens", m.reused_tokens)
        self.inc("swapped_tokens", m.swapped_tokens)
        self.inc("recomputed_tokens", m.recomputed_tokens)
        self.inc("generation_tokens", m.output_tokens)
        if m.reused_tokens:
            self.inc("turns_with_reuse")
        self.observe("time_to_first_token_seconds", m.ttft)
        self.observe("time_per_output_token_seconds", m.tpot)
        self.observe("e2e_request_latency_seconds", m.latency)
        self.observe("request_queue_time_seconds", m.queue_time)
        if out.finish_reason != "error":
            self.observe("turn_recomputed_tokens", m.recomputed_tokens)
            self.observe("turn_reused_tokens", m.reused_tokens)

    def moved(self, batch) -> None:
        """A store move batch (moves.MoveBatch): the restore time of chunks brought up to the device."""
        if batch.dst == "device":
            self.observe("restore_seconds", batch.seconds, tier=batch.src)

    def snapshot(self) -> list[dict]:
        """Every family of this replica as plain data (exposition.families), without a replica label."""
        return families(self.registry.collect())
