"""docs/grafana/stateful-hf.json: every PromQL expression parses (promql-parser) and names only
metrics the server exports, checked against a real /metrics scrape over HTTP after a few requests
(a histogram family F is queried as F_bucket / F_sum / F_count, a counter F as F_total)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
promql_parser = pytest.importorskip("promql_parser")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from stateful_hf.serve import EngineOptions, ServerThread, build_local  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "stateful-hf.json"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",),
            "summary": ("_sum", "_count", ""), "info": ("_info",), "unknown": ("",)}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (parsed by promql-parser; Grafana's $__ intervals as 5m)."""
    node = promql_parser.parse(re.sub(r"\$__\w+", "5m", expr))

    def walk(n) -> set[str]:
        if isinstance(n, promql_parser.VectorSelector):
            return {n.name} if n.name else {m.value for m in n.matchers.matchers if m.name == "__name__"}
        if isinstance(n, promql_parser.MatrixSelector):
            return walk(n.vector_selector)
        if isinstance(n, promql_parser.BinaryExpr):
            return walk(n.lhs) | walk(n.rhs)
        if isinstance(n, promql_parser.AggregateExpr):
            return walk(n.expr) | (walk(n.param) if n.param is not None else set())
        if isinstance(n, promql_parser.Call):
            return set().union(*(walk(a) for a in n.args))
        if isinstance(n, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            return walk(n.expr)
        assert isinstance(n, (promql_parser.NumberLiteral, promql_parser.StringLiteral)), type(n)
        return set()

    return walk(node)


def test_metric_names_parser():
    got = metric_names('histogram_quantile(0.9, sum by (le, tier) (rate(stateful_hf_x_bucket{replica=~"$r",'
                       'reason=~"a|b"}[$__rate_interval]))) / on (tier) group_left sum without (le) (y_total > 0)')
    assert got == {"stateful_hf_x_bucket", "y_total"}
    with pytest.raises(Exception):                               # noqa: B017 - the parser's own error type
        metric_names("sum(rate(x[5m])")


def _expressions(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        out += [t["expr"] for t in p.get("targets", [])]
        out += [t["expr"] for q in p.get("panels", []) for t in q.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, dict) and "query" in q:
            out.append(re.sub(r"^label_values\((\w+),.*\)$", r"\1", q["query"]))
    return out


@pytest.fixture(scope="module")
def scraped() -> set[str]:
    """Every sample name the server's families can have, from a real scrape after a few requests."""
    opts = EngineOptions(device_capacity=64, host_capacity=4096, chunk_size=8)
    app, router = build_local(tiny_llama(), tiny_tokenizer(), "tiny", opts)
    try:
        with ServerThread(app) as srv, httpx.Client(timeout=60) as http:
            for turn in range(2):
                for i in range(3):
                    r = http.post(srv.url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"The story number {i} of the lighthouse, part {turn}",
                        "max_tokens": 3, "temperature": 0, "session_id": f"s{i}"})
                    assert r.status_code == 200, r.text
            assert http.post(srv.url + "/v1/hints", json={"session_id": "s0"}).status_code == 200
            page = http.get(srv.url + "/metrics").text
    finally:
        for c in router.clients:
            c.replica.shutdown()
    names = set()
    for f in text_string_to_metric_families(page):
        names |= {f.name + s for s in SUFFIXES[f.type]} | {s.name for s in f.samples}
    return names


def test_every_dashboard_expression_names_an_exported_metric(scraped):
    dash = json.loads(DASHBOARD.read_text())
    exprs = _expressions(dash)
    assert len(exprs) >= 30
    used = set()
    for e in exprs:
        names = metric_names(e)
        assert names, e
        missing = names - scraped
        assert not missing, f"{e}: not exported: {sorted(missing)}"
        used |= names
    # what the dashboard is for: latency percentiles, throughput, occupancy, reuse vs recompute, moves
    for family in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert any(f"stateful_hf_{family}_bucket" in e and "histogram_quantile" in e for e in exprs), family
    for name in ("generation_tokens_total", "tier_tokens", "reused_tokens_total", "recomputed_tokens_total",
                 "tier_move_bytes_total", "tier_move_chunks_total", "restore_seconds_bucket", "requests_waiting",
                 "hint_lead_time_seconds_bucket"):
        assert "stateful_hf_" + name in used, name
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "stateful-hf"
