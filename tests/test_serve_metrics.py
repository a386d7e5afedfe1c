"""/metrics: prometheus_client's parser reads the page of a two-replica router (in-process); every
family has its type and HELP, every replica's samples carry its label, and the values are those of
their owners (the stores' statistics and move ledgers, the requests' outputs)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("fastapi")
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from stateful_hf import SamplingParams  # noqa: E402
from stateful_hf.cache.audit.stats import Counters  # noqa: E402
from stateful_hf.serve import LocalClient, Replica, Router  # noqa: E402
from stateful_hf.serve.metrics import STORE_COUNTERS, STORE_STAT_COUNTERS, UNEXPORTED_COUNTERS  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

N = 4
P = "stateful_hf_"


def _router() -> Router:
    tok = tiny_tokenizer()
    opts = EngineOptions(device_capacity=64, host_capacity=4096, chunk_size=8)   # 8 device blocks: moves
    return Router([LocalClient(Replica(opts.build(tiny_llama(), tok), name=f"r{i}")) for i in range(2)])


async def _turn(router: Router, sid: str | None, ids: list[int]) -> dict:
    final = None
    async for ev in router.stream(sid, ids, SamplingParams(max_new_tokens=N)):
        final = ev
    assert final["type"] == "done", final
    return final


def parse(page: str) -> dict:
    """name -> (type, help, [(sample name, labels, value)])."""
    return {f.name: (f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(page)}


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    """Sum of a family's samples named `sample` (default: the family's own) whose labels include `labels`."""
    _, _, samples = fams[P + family]
    want = P + (sample or family)
    return sum(v for n, ls, v in samples if n == want and all(ls.get(k) == str(x) for k, x in labels.items()))


async def _workload(router: Router) -> list[dict]:
    finals, convs = [], {f"s{i}": [5 + i, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49] * 3 for i in range(6)}
    for _ in range(2):
        for sid, ids in convs.items():
            out = await _turn(router, sid, ids)
            finals.append(out)
            convs[sid] = ids + out["token_ids"] + [7, 11, 15]
    await router.hint("s0", 0.0)                    # lead time; perhaps a migration
    await router.wait_migrations()
    finals.append(await _turn(router, "s0", convs["s0"]))
    finals.append(await _turn(router, None, [3, 4, 5]))   # a throwaway session
    return finals


def test_page_parses_with_types_help_replica_labels_and_owner_values():
    router = _router()

    async def main():
        finals = await _workload(router)
        return finals, parse(await router.metrics_text())

    finals, fams = asyncio.run(main())
    try:
        kinds = {"time_to_first_token_seconds": "histogram", "time_per_output_token_seconds": "histogram",
                 "e2e_request_latency_seconds": "histogram", "turn_recomputed_tokens": "histogram",
                 "restore_seconds": "histogram", "hint_lead_time_seconds": "histogram", "requests": "counter",
                 "reused_tokens": "counter", "recomputed_tokens": "counter", "hints": "counter",
                 "migrations_in": "counter", "tier_move_bytes": "counter", "store_swapped_in_host_tokens": "counter",
                 "tier_tokens": "gauge", "tier_reserved_bytes": "gauge", "requests_waiting": "gauge",
                 "router_requests": "counter", "router_inflight_requests": "gauge"}
        for name, kind in kinds.items():
            assert fams[P + name][0] == kind, name
        assert all(help_ for _, help_, _ in fams.values())
        names = [c.name for c in router.clients]
        for family in ("requests", "tier_tokens", "store_device_hits_tokens", "sessions", "requests_waiting"):
            got = {ls["replica"] for _, ls, _ in fams[P + family][2]}
            assert got == set(names), family
        for i, r in enumerate(names):
            replica = router.clients[i].replica
            st = replica.store.stats()
            assert value(fams, "tier_tokens", replica=r, tier="device") == st.device_tokens
            assert value(fams, "tier_tokens", replica=r, tier="host") == st.host_tokens
            assert value(fams, "tier_bytes", replica=r, tier="host") == st.host_bytes
            assert value(fams, "tier_reserved_bytes", replica=r, tier="device") == st.device_reserved_bytes
            assert value(fams, "sessions", replica=r) == st.sessions
            for field, (name, _) in STORE_COUNTERS.items():
                assert value(fams, name, name + "_total", replica=r) == pytest.approx(getattr(st.counters, field))
            for field, (name, _) in STORE_STAT_COUNTERS.items():
                assert value(fams, name, name + "_total", replica=r) == getattr(st, field)
            assert value(fams, "disk_degraded", replica=r) == float(st.disk_degraded)
            served = [f for f in finals if f["replica"] == r]
            assert value(fams, "requests", "requests_total", replica=r) == len(served)
            assert value(fams, "time_to_first_token_seconds", "time_to_first_token_seconds_count",
                         replica=r) == len(served)
            assert value(fams, "reused_tokens", "reused_tokens_total", replica=r) == sum(
                f["reused_tokens"] for f in served)
            assert value(fams, "recomputed_tokens", "recomputed_tokens_total", replica=r) == sum(
                f["recomputed_tokens"] for f in served)
            assert value(fams, "generation_tokens", "generation_tokens_total", replica=r) == sum(
                f["completion_tokens"] for f in served)
            # the move ledger agrees with the store's token counters, and the restore histogram with it
            moves = replica.store.moves.snapshot()
            for (src, dst), field in {("device", "host"): "swapped_out_host", ("host", "device"): "swapped_in_host",
                                      ("device", "dropped"): "dropped"}.items():
                tokens = sum(t.tokens for (s, d, _), t in moves.items() if (s, d) == (src, dst))
                assert tokens == getattr(st.counters, field), (r, src, dst)
                assert value(fams, "tier_move_tokens", "tier_move_tokens_total", replica=r, src=src,
                             dst=dst) == tokens
            batches_up = sum(t.batches for (s, d, _), t in moves.items() if (s, d) == ("host", "device"))
            assert value(fams, "restore_seconds", "restore_seconds_count", replica=r, tier="host") == batches_up
        # the workload moved KV both ways (8 device blocks, 3 sessions of ~40 tokens per replica)
        assert value(fams, "tier_move_chunks", "tier_move_chunks_total", src="device", dst="host") > 0
        assert value(fams, "tier_move_bytes", "tier_move_bytes_total", src="host", dst="device") > 0
        assert value(fams, "hint_lead_time_seconds", "hint_lead_time_seconds_count") == 1
        assert value(fams, "router_requests", "router_requests_total") == len(finals)
        assert value(fams, "router_replica_up") == 2
        assert value(fams, "hints", "hints_total") == 1
    finally:
        asyncio.run(router.shutdown())


def test_every_store_counter_is_exported_or_deliberately_not():
    """Adding a field to the store's Counters is one line in metrics.STORE_COUNTERS (or UNEXPORTED_COUNTERS)."""
    fields = {f.name for f in dataclasses.fields(Counters)}
    assert fields == set(STORE_COUNTERS) | UNEXPORTED_COUNTERS
    assert not set(STORE_COUNTERS) & UNEXPORTED_COUNTERS


class _Down:
    name = "gone"

    async def snapshot(self):
        raise ConnectionError("replica unreachable")

    async def session_tokens(self, session_id):
        return 0

    async def shutdown(self):
        pass


def test_a_replica_that_does_not_answer_is_reported_not_fatal():
    tok = tiny_tokenizer()
    up = Replica(EngineOptions(device_capacity=256).build(tiny_llama(), tok), name="up")
    router = Router([LocalClient(up), _Down()])

    async def main():
        await _turn(router, "x", [1, 2, 3])
        page, content_type = await router.metrics_page()
        om, om_type = await router.metrics_page("application/openmetrics-text; version=1.0.0")
        return page.decode(), content_type, om.decode(), om_type

    page, content_type, om, om_type = asyncio.run(main())
    try:
        fams = parse(page)
        assert content_type.startswith("text/plain") and om_type.startswith("application/openmetrics-text")
        assert om.rstrip().endswith("# EOF")
        om_fams = {f.name: f.type for f in openmetrics_families(om)}     # the OpenMetrics parser accepts it
        assert om_fams[P + "requests"] == "counter" and om_fams[P + "time_to_first_token_seconds"] == "histogram"
        assert value(fams, "router_replica_up", replica="up") == 1 and value(fams, "router_replica_up",
                                                                             replica="gone") == 0
        assert {ls["replica"] for _, ls, _ in fams[P + "requests"][2]} == {"up"}
    finally:
        up.shutdown()


def test_error_responses_are_counted_by_status_and_code():
    """Every error the app answers (a handler's or the key guard's) counts once, labelled by its HTTP
    status and OpenAI error code: an unknown model, a bad body, a missing key, an unknown session."""
    from fastapi.testclient import TestClient

    from stateful_hf.serve.app import ServeConfig, create_app
    from stateful_hf.serve.auth import Access, KeyRing

    router = _router()
    app = create_app(router, ServeConfig("m", tiny_tokenizer(), 512), Access(keys=KeyRing("k0")))
    auth = {"Authorization": "Bearer k0"}
    with TestClient(app) as client:
        chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 404
        assert client.post("/v1/chat/completions", content=b"{", headers=auth).status_code == 400
        assert client.post("/v1/chat/completions", json=chat).status_code == 401
        assert client.delete("/v1/sessions/ghost", headers=auth).status_code == 404
        assert client.delete("/v1/sessions/ghost", headers=auth).status_code == 404
        fams = parse(client.get("/metrics").text)
    assert value(fams, "api_errors", "api_errors_total", status=404, code="model_not_found") == 1
    assert value(fams, "api_errors", "api_errors_total", status=400, code="invalid_json") == 1
    assert value(fams, "api_errors", "api_errors_total", status=401, code="missing_api_key") == 1
    assert value(fams, "api_errors", "api_errors_total", status=404, code="session_not_found") == 2
    assert value(fams, "api_errors", "api_errors_total") == 5
