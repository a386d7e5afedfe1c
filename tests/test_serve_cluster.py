"""Cluster logic without Ray: the router over two in-process replicas, hint-driven KV migration
(export from the holder's tiers, import onto the target's device), soft affinity, balance."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.serve import LocalClient, Replica, Router, SessionExport, export_session, import_session  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

N = 6


def _ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def _stateless(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _cluster(tmp_path=None, n: int = 2, **opts) -> Router:
    tok = tiny_tokenizer()
    replicas = []
    for i in range(n):
        disk = str(tmp_path / f"disk{i}") if tmp_path is not None else None
        o = EngineOptions(**{"device_capacity": 4096, "disk_capacity": 4096 if disk else None, **opts})
        replicas.append(Replica(o.build(tiny_llama(), tok, disk_dir=disk), name=f"r{i}"))
    return Router([LocalClient(r) for r in replicas])


async def _turn(router: Router, sid: str, ids: list[int], n: int = N) -> dict:
    final = None
    async for ev in router.stream(sid, ids, SamplingParams(max_new_tokens=n)):
        final = ev
    assert final["type"] == "done", final
    return final


def _store(router: Router, i: int):
    return router.clients[i].replica.store


def test_export_import_every_tier_is_exact(tmp_path):
    """A session spread over device, host, disk and dropped chunks moves to another store; the next
    turn there equals stateless generate and recomputes only the dropped tokens."""
    tok, model = tiny_tokenizer(), tiny_llama()
    kw = dict(chunk_size=8, host_capacity=4096)
    a = Engine(model, tok, EngineOptions(device_capacity=4096, disk_capacity=4096, **kw).build(
        model, tok, str(tmp_path / "a")).store)
    other = tiny_llama()
    b = Engine(other, tok, EngineOptions(device_capacity=4096, **kw).build(other, tok).store)
    msgs = [{"role": "user", "content": "Tell me about the weather, the sea and the mountains at night."}]
    out = a.submit("s", _ids(tok, msgs), SamplingParams(max_new_tokens=N)).result()
    chunks = len(a.store.session("s").chunks)
    assert chunks >= 4
    a.store.move("s", [0], "dropped")
    a.store.move("s", [1], "disk")
    a.store.move("s", [2], "host")
    exp = export_session(a.store, "s")
    assert exp.chunks == list(range(1, chunks)) and exp.kv.shape[0] == chunks - 1
    path = tmp_path / "s.safetensors"            # the shared-directory transport round-trips exactly
    exp.save(path)
    back = SessionExport.load(path)
    assert back.token_ids == exp.token_ids and torch.equal(back.kv, exp.kv) and back.chunks == exp.chunks
    assert import_session(b.store, back) == exp.kv_tokens
    b.store.check_integrity()
    res = b.store.residency("s")
    assert res["dropped"] == 8 and res["device"] == len(exp.token_ids) - 8
    msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": "And the stars?"}]
    ids = _ids(tok, msgs)
    nxt = b.submit("s", ids, SamplingParams(max_new_tokens=N)).result()
    assert list(nxt.token_ids) == _stateless(model, ids, N)
    assert nxt.metrics.recomputed_tokens == 8 and b.store.stats().counters.recomputed == 8


def test_hint_moves_session_to_other_replica_exact_no_recompute():
    router, tok, model = _cluster(), tiny_tokenizer(), tiny_llama()

    async def main():
        msgs = [{"role": "user", "content": "Hello! How are you today? Tell me about the sea."}]
        first = await _turn(router, "alice", _ids(tok, msgs))
        src = router.names.index(first["replica"])
        history = list(_store(router, src).session("alice").token_ids)
        hint = await router.hint("alice", expected_arrival=0.5)
        assert hint["migrating"] and hint["replica"] != first["replica"]
        dst = router.names.index(hint["replica"])
        msgs += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And the stars?"}]
        ids = _ids(tok, msgs)
        second = await _turn(router, "alice", ids)          # may arrive mid-migration: it waits
        assert second["replica"] == hint["replica"]
        assert second["token_ids"] == _stateless(model, ids, N)
        assert second["recomputed_tokens"] == 0
        common = next((k for k, (x, y) in enumerate(zip(history, ids)) if x != y), min(len(history), len(ids)))
        assert second["reused_tokens"] == min(common, len(ids) - 1) > 0    # all of the shared prefix
        assert "alice" not in _store(router, src)           # the holder let it go
        assert _store(router, dst).stats().counters.recomputed == 0
        assert router.stats["migrations"] == 1
        page = await router.metrics_text()
        assert f'stateful_hf_migrations_in_total{{replica="{hint["replica"]}"}} 1' in page
        await router.shutdown()

    asyncio.run(main())


def test_skewed_sessions_stay_balanced_and_exact():
    """One hot session and a few cold ones, each turn announced by a hint: per-request balancing
    keeps the replicas within one request of each other; every turn equals a single engine's."""
    router, tok = _cluster(), tiny_tokenizer()
    reference = Engine(tiny_llama(), tok)
    plan = ["hot"] * 9 + ["cold-1"] * 3 + ["cold-2"] * 2 + ["cold-3"]
    order = [plan[(i * 7) % len(plan)] for i in range(len(plan))]     # interleaved, still skewed
    assert sorted(order) == sorted(plan)

    async def main():
        convs: dict[str, list[dict]] = {}
        for k, sid in enumerate(order):
            conv = convs.setdefault(sid, [])
            conv.append({"role": "user", "content": f"question {k} of {sid}"})
            await router.hint(sid)
            out = await _turn(router, sid, _ids(tok, conv))
            want = reference.submit(sid, _ids(tok, conv), SamplingParams(max_new_tokens=N)).result()
            assert out["token_ids"] == list(want.token_ids), (k, sid)
            assert out["recomputed_tokens"] == 0
            conv.append({"role": "assistant", "content": out["text"]})
        assert sum(router.assigned) == len(order)
        assert abs(router.assigned[0] - router.assigned[1]) <= 1, router.assigned
        assert router.stats["migrations"] > 0
        await router.shutdown()

    asyncio.run(main())


def test_soft_affinity_without_hints():
    """No hints: a session's turns stay on its holder (reusing its KV) unless the holder is
    overloaded; then the request goes to the least-loaded replica, which pulls the KV first."""
    router, tok, model = _cluster(), tiny_tokenizer(), tiny_llama()

    async def main():
        msgs = [{"role": "user", "content": "Servers re-read the whole conversation."}]
        first = await _turn(router, "bob", _ids(tok, msgs))
        holder = router.names.index(first["replica"])
        msgs += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Why?"}]
        second = await _turn(router, "bob", _ids(tok, msgs))
        assert second["replica"] == first["replica"] and second["reused_tokens"] > 0
        router.load[holder] += router.overload_slack + 1        # the holder is busy with other work
        msgs += [{"role": "assistant", "content": second["text"]}, {"role": "user", "content": "Go on."}]
        ids = _ids(tok, msgs)
        third = await _turn(router, "bob", ids)
        router.load[holder] -= router.overload_slack + 1
        assert third["replica"] != first["replica"]
        assert third["token_ids"] == _stateless(model, ids, N) and third["recomputed_tokens"] == 0
        assert router.stats["affinity_overridden"] == 1 and router.stats["migrations"] == 1
        await router.shutdown()

    asyncio.run(main())


def test_concurrent_hints_and_turns_many_sessions():
    """Hints racing turns over many sessions: nothing lost, every reply exact."""
    router, tok = _cluster(), tiny_tokenizer()
    reference = Engine(tiny_llama(), tok)
    sids = [f"u{i}" for i in range(12)]

    async def main():
        convs = {s: [] for s in sids}
        for turn in range(3):
            for s in sids:
                convs[s].append({"role": "user", "content": f"{s} says hello {turn}"})

            async def one(s):
                await router.hint(s)
                return s, await _turn(router, s, _ids(tok, convs[s]))
            results = dict(await asyncio.wait_for(asyncio.gather(*(one(s) for s in sids)), 60))
            wants = reference.generate(sids, [_ids(tok, convs[s]) for s in sids], SamplingParams(max_new_tokens=N))
            for s, w in zip(sids, wants):
                assert results[s]["token_ids"] == list(w.token_ids), (turn, s)
                convs[s].append({"role": "assistant", "content": results[s]["text"]})
        await router.wait_migrations()
        for s in sids:      # each session lives on exactly one replica
            assert sum(s in _store(router, i) for i in range(2)) == 1
        for i in range(2):
            _store(router, i).check_integrity()
        await router.shutdown()

    asyncio.run(main())


def test_new_router_finds_sessions_on_replicas(tmp_path):
    """A router that has never seen a session (restarted) asks the replicas where it is; a hint
    then migrates it from there, and the turn reuses it rather than recomputing."""
    router, tok, model = _cluster(), tiny_tokenizer(), tiny_llama()

    async def main():
        msgs = [{"role": "user", "content": "Chunks of thirty-two tokens move between the tiers."}]
        first = await _turn(router, "carl", _ids(tok, msgs))
        fresh = Router(router.clients)                     # same replicas, no memory of sessions
        fresh.assigned[router.names.index(first["replica"])] = 1
        hint = await fresh.hint("carl")
        assert hint["migrating"] and hint["replica"] != first["replica"]
        msgs += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Which tiers?"}]
        ids = _ids(tok, msgs)
        out = await _turn(fresh, "carl", ids)
        assert out["replica"] == hint["replica"] and out["reused_tokens"] > 0 and out["recomputed_tokens"] == 0
        assert out["token_ids"] == _stateless(model, ids, N)
        await router.shutdown()

    asyncio.run(main())


def test_unused_hint_expires():
    """A hint whose request never comes stops counting as expected load after expected_arrival + ttl."""
    router = _cluster()
    router.hint_ttl = 0.05

    async def main():
        hint = await router.hint("ghost", expected_arrival=0.0)
        i = router.names.index(hint["replica"])
        assert router.expected[i] == 1 and "ghost" in router.planned
        await asyncio.sleep(0.1)
        await router.hint("other")                   # any routing decision drops expired plans
        assert "ghost" not in router.planned and sum(router.expected) == 1      # only "other" counts
        await router.shutdown()

    asyncio.run(main())


def test_export_hidden_state_chunks_is_exact():
    """HCache chunks (hidden states, no K/V) are projected back to K/V before export; the importer
    (a store without a hidden tier) continues exactly, recomputing nothing."""
    tok, model = tiny_tokenizer(), tiny_llama()
    a = EngineOptions(device_capacity=4096, host_capacity=4096, chunk_size=8,
                      hidden_states="always").build(model, tok)
    other = tiny_llama()
    b = EngineOptions(device_capacity=4096, chunk_size=8).build(other, tok)
    msgs = [{"role": "user", "content": "Please summarize the previous answer in one sentence."}]
    out = a.submit("h", _ids(tok, msgs), SamplingParams(max_new_tokens=N)).result()
    a.store.move("h", [0, 1], "hidden")
    assert a.store.residency("h")["hidden"] == 16
    import_session(b.store, export_session(a.store, "h"))
    assert b.store.residency("h")["dropped"] == 0
    msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": "Shorter."}]
    ids = _ids(tok, msgs)
    nxt = b.submit("h", ids, SamplingParams(max_new_tokens=N)).result()
    assert list(nxt.token_ids) == _stateless(model, ids, N) and nxt.metrics.recomputed_tokens == 0


def test_prefix_affinity_routes_shared_prompts_to_their_replica():
    """Requests whose KV is nowhere (no session id, or a new session) go to the replica that served
    the longest prefix of their prompt in their scope, which reuses the shared chunks; exact. Another
    cache_salt does not match; an overloaded holder of the prefix is passed over."""
    router, model = _cluster(), tiny_llama()
    system = [(7 * i) % 90 + 3 for i in range(80)]           # 2 full 32-token blocks and a bit

    async def main():
        first = await _turn(router, None, system + [11, 12, 13])
        at = router.names.index(first["replica"])
        router.assigned[at] += 5                              # without affinity the other replica is next
        for sid, tail in [(None, [14, 15]), ("carol", [16, 17, 18])]:
            ids = system + tail
            out = await _turn(router, sid, ids)
            assert out["replica"] == first["replica"] and out["reused_tokens"] >= 64
            assert out["token_ids"] == _stateless(model, ids, N)
        assert router.stats["prefix_routed"] == 2
        salted = []
        async for ev in router.stream(None, system + [19], SamplingParams(max_new_tokens=N), cache_salt="s"):
            salted.append(ev)
        assert salted[-1]["replica"] != first["replica"] and salted[-1]["reused_tokens"] == 0
        router.load[at] += router.overload_slack + 1          # the prefix's replica is busy
        ids = system + [20, 21]
        out = await _turn(router, None, ids)
        router.load[at] -= router.overload_slack + 1
        assert out["replica"] != first["replica"] and out["token_ids"] == _stateless(model, ids, N)
        assert router.stats["prefix_affinity_overridden"] == 1
        for i in range(2):
            _store(router, i).check_integrity()
        await router.shutdown()

    asyncio.run(main())


def test_prefix_affinity_keys_and_capacity():
    from stateful_hf.serve.prefix_affinity import PrefixAffinity
    a = PrefixAffinity(block_tokens=4, max_blocks=3, capacity=4)
    k = a.keys(list(range(14)), "t", None)
    assert len(k) == 3 and a.keys(list(range(14)), "u", None)[0] != k[0]
    assert a.keys(list(range(12)) + [99], "t", None) == k                 # only full blocks count
    assert a.lookup(k) == (None, 0)
    a.record(k[:2], 1)
    assert a.lookup(k) == (1, 2) and a.lookup(a.keys([0, 1, 2, 9, 4], "t", None)) == (None, 0)
    a.record(a.keys(list(range(100, 112)), "t", None), 0)                # 3 more keys: the oldest leaves
    assert len(a) == 4 and a.lookup(k) == (1, 2)                          # looked up last: kept
    with pytest.raises(ValueError):
        PrefixAffinity(block_tokens=0)
