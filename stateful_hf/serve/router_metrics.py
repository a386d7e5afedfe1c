"""The router's own series (in a registry of its own): where requests went, migrations, hint lead
times, replicas' in-flight load, whether each replica answered the scrape, and the served model
(`stateful_hf_model_info{model_name}`, once the app names it: the `model_name` label of the vLLM
names, `vllm_metrics.py`). Read from the router's state at scrape time, except the hint lead time
histogram, observed when a hinted session's request arrives."""

from __future__ import annotations

import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .exposition import families
from .metrics import PREFIX
from .vllm_metrics import MODEL_INFO

HINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _RouterCollector:
    def __init__(self, router):
        self.router = router

    def collect(self):
        r, names = self.router, self.router.names

        def per_replica(family, values):
            for n, v in zip(names, values):
                family.add_metric([n], float(v))
            return family

        yield per_replica(CounterMetricFamily(f"{PREFIX}_router_requests", "Requests the router sent to each replica",
                                              labels=["replica"]), r.assigned)
        yield per_replica(GaugeMetricFamily(f"{PREFIX}_router_inflight_requests", "Requests in flight on each replica "
                                            "(the router's view; summed: the global queue depth)", labels=["replica"]),
                          r.load)
        yield per_replica(GaugeMetricFamily(f"{PREFIX}_router_hinted_requests", "Hinted requests expected on each "
                                            "replica", labels=["replica"]), r.expected)
        up = GaugeMetricFamily(f"{PREFIX}_router_replica_up", "1 if the replica answered the last metrics scrape",
                               labels=["replica"])
        yield per_replica(up, [int(n not in r.metrics.unreachable) for n in names])
        m = CounterMetricFamily(f"{PREFIX}_router_migrations", "Session KV migrations between replicas",
                                labels=["result"])
        m.add_metric(["ok"], r.stats["migrations"])
        m.add_metric(["failed"], r.stats["migrations_failed"])
        yield m
        yield CounterMetricFamily(f"{PREFIX}_router_migration_seconds", "Wall time of migrations",
                                  value=r.migration_seconds)
        yield CounterMetricFamily(f"{PREFIX}_router_affinity_overridden", "Requests sent away from the replica holding "
                                  "their session because it was overloaded", value=r.stats["affinity_overridden"])
        yield GaugeMetricFamily(f"{PREFIX}_router_sessions", "Sessions whose holder the router knows",
                                value=len(r.location))
        if r.metrics.model_name is not None:
            info = GaugeMetricFamily(MODEL_INFO, "The model this server serves (value 1)", labels=["model_name"])
            info.add_metric([r.metrics.model_name], 1.0)
            yield info


class RouterMetrics:
    def __init__(self, router, hint_ttl: float):
        self.registry = CollectorRegistry(auto_describe=False)
        self.hint_lead = Histogram(f"{PREFIX}_hint_lead_time_seconds", "Time from a session's first hint to its "
                                   "request's arrival at the router", buckets=HINT_BUCKETS, registry=self.registry)
        # every error response of the HTTP app, by status and OpenAI error code (a fixed set: no ids)
        self.errors = Counter(f"{PREFIX}_api_errors", "Requests answered with an error, by HTTP status and error "
                              "code", labelnames=["status", "code"], registry=self.registry)
        self.registry.register(_RouterCollector(router))
        self.hint_ttl = hint_ttl
        self.model_name: str | None = None               # the served model (set by the app: utility.install)
        self.unreachable: set[str] = set()               # replicas that failed the last scrape
        self._hinted: OrderedDict[str, float] = OrderedDict()   # session -> its first unanswered hint (monotonic)

    def hinted(self, session_id: str) -> None:
        now = time.monotonic()
        while self._hinted and next(iter(self._hinted.values())) < now - self.hint_ttl:
            self._hinted.popitem(last=False)             # a hint whose request never came
        self._hinted.setdefault(session_id, now)

    def arrived(self, session_id: str | None) -> None:
        t = self._hinted.pop(session_id, None) if session_id is not None else None
        if t is not None:
            self.hint_lead.observe(time.monotonic() - t)

    def error(self, e) -> None:
        """An error response (an `APIError`) was sent."""
        self.errors.labels(str(e.status), e.code or e.type).inc()

    def snapshot(self) -> list[dict]:
        return families(self.registry.collect())
