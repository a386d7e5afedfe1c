"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Each replica keeps its own counters and histograms (`ReplicaMetrics`) and reports a plain-dict
snapshot together with its store's statistics; `render` turns the snapshots of all replicas into
one page, every sample labelled with its replica.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import asdict

PREFIX = "stateful_hf"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# name -> (type, help)
COUNTERS = {
    "requests_total": "Finished requests, by finish reason",
    "prompt_tokens_total": "Prompt (conversation) tokens of finished requests",
    "reused_tokens_total": "History tokens served from stored KV (any tier) instead of being computed",
    "recomputed_tokens_total": "History tokens recomputed because their KV had been dropped",
    "generation_tokens_total": "Generated tokens",
    "turns_with_reuse_total": "Finished requests that reused stored KV",
    "hints_total": "Hints (advisory requests) received",
    "hint_prefetched_tokens_total": "Tokens moved up to the device by finished hints",
    "migrations_in_total": "Sessions imported from another replica",
    "migrations_out_total": "Sessions exported to another replica",
    "migrated_tokens_total": "Tokens whose KV was imported from another replica",
    "migration_seconds_total": "Wall time spent importing sessions",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Arrival to first generated token",
    "time_per_output_token_seconds": "Mean time per output token after the first",
    "e2e_request_latency_seconds": "Arrival to last token",
}
STORE_COUNTERS = {
    "device_hits": "History tokens a step found on the device",
    "swapped_in_host": "Tokens copied host -> device",
    "swapped_in_disk": "Tokens copied disk -> device",
    "swapped_out_host": "Tokens copied device -> host",
    "swapped_out_disk": "Tokens copied to disk",
    "dropped": "Tokens whose KV was discarded (ids kept)",
    "recomputed": "Dropped history tokens computed again",
    "restored_hidden": "Tokens whose K/V was rebuilt from hidden states",
}


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


class ReplicaMetrics:
    """Counters and histograms of one replica; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counters: dict[str, dict[tuple, float]] = {n: {} for n in COUNTERS}
        self.histograms = {n: Histogram() for n in HISTOGRAMS}

    def inc(self, name: str, value: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            c = self.counters[name]
            c[key] = c.get(key, 0) + value

    def observe(self, name: str, value: float | None) -> None:
        if value is not None:
            with self._lock:
                self.histograms[name].observe(value)

    def finished(self, out) -> None:
        """Account one finished RequestOutput."""
        m = out.metrics
        self.inc("requests_total", finish_reason=out.finish_reason or "unknown")
        self.inc("prompt_tokens_total", m.prompt_tokens)
        self.inc("reused_tokens_total", m.reused_tokens)
        self.inc("recomputed_tokens_total", m.recomputed_tokens)
        self.inc("generation_tokens_total", m.output_tokens)
        if m.reused_tokens:
            self.inc("turns_with_reuse_total")
        self.observe("time_to_first_token_seconds", m.ttft)
        self.observe("time_per_output_token_seconds", m.tpot)
        self.observe("e2e_request_latency_seconds", m.latency)

    def snapshot(self) -> dict:
        with self._lock:
            return {"counters": {n: [[list(k), v] for k, v in c.items()] for n, c in self.counters.items()},
                    "histograms": {n: h.snapshot() for n, h in self.histograms.items()}}


def store_snapshot(store, engine=None) -> dict:
    """Gauges from the store (and engine): plain data."""
    st = store.stats()
    out = {"sessions": st.sessions, "block_size": st.block_size,
           "tiers": {t: {"tokens": getattr(st, f"{t}_tokens"), "bytes": getattr(st, f"{t}_bytes", 0),
                         "capacity_tokens": getattr(st, f"{t}_capacity_tokens", 0)}
                     for t in ("device", "host", "disk")},
           "dropped_tokens": st.dropped_tokens, "hit_rate": st.hit_rate,
           "store_counters": {k: v for k, v in asdict(st.counters).items() if k in STORE_COUNTERS}}
    if engine is not None:
        es = engine.stats()
        out["engine"] = {"running": es.running, "waiting": es.waiting, "steps": es.steps}
    return out


def _labels(d: dict) -> str:
    if not d:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in d.items())
    return "{" + body + "}"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(replicas: dict[str, dict]) -> str:
    """replicas: name -> {"metrics": ReplicaMetrics.snapshot(), "store": store_snapshot(...)}."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict, float]]) -> None:
        full = f"{PREFIX}_{name}"
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        for suffix, labels, v in samples:
            lines.append(f"{full}{suffix}{_labels(labels)} {_num(v)}")

    for name, help_ in COUNTERS.items():
        samples = []
        for r, snap in replicas.items():
            entries = snap["metrics"]["counters"].get(name, [])
            if not entries and name != "requests_total":
                entries = [[[], 0]]
            samples += [("", {"replica": r, **dict(k)}, v) for k, v in entries]
        family(name, "counter", help_, samples)
    for name, help_ in HISTOGRAMS.items():
        samples = []
        for r, snap in replicas.items():
            h = snap["metrics"]["histograms"][name]
            acc = 0
            for le, c in zip([*h["buckets"], "+Inf"], h["counts"]):
                acc += c
                samples.append(("_bucket", {"replica": r, "le": le}, acc))
            samples += [("_sum", {"replica": r}, float(h["sum"])), ("_count", {"replica": r}, acc)]
        family(name, "histogram", help_, samples)
    gauges = {"tier_tokens": ("tokens", "Tokens whose KV is in a tier"),
              "tier_bytes": ("bytes", "Bytes of a tier in use"),
              "tier_capacity_tokens": ("capacity_tokens", "Capacity of a tier in tokens")}
    for name, (key, help_) in gauges.items():
        family(name, "gauge", help_, [("", {"replica": r, "tier": t}, v[key])
                                      for r, s in replicas.items() for t, v in s["store"]["tiers"].items()])
    family("dropped_tokens", "gauge", "Tokens with only their ids kept",
           [("", {"replica": r}, s["store"]["dropped_tokens"]) for r, s in replicas.items()])
    family("sessions", "gauge", "Sessions in the store", [("", {"replica": r}, s["store"]["sessions"])
                                                          for r, s in replicas.items()])
    family("kv_hit_rate", "gauge", "Share of needed history tokens served from stored KV",
           [("", {"replica": r}, float(s["store"]["hit_rate"])) for r, s in replicas.items()])
    for key, help_ in STORE_COUNTERS.items():
        family(f"store_{key}_tokens_total", "counter", help_,
               [("", {"replica": r}, s["store"]["store_counters"][key]) for r, s in replicas.items()])
    for key in ("running", "waiting"):
        family(f"requests_{key}", "gauge", f"Requests {key} in the engine",
               [("", {"replica": r}, s["store"]["engine"][key]) for r, s in replicas.items()
                if "engine" in s["store"]])
    return "\n".join(lines) + "\n"
