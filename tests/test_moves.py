"""The store's move ledger: every batch of chunks moved between tiers is recorded with its source,
target and reason; the totals agree with the store's token counters; each batch logs one line."""

from __future__ import annotations

import logging

import pytest

from stateful_hf import Engine, SamplingParams
from stateful_hf.testing import tiny_llama, tiny_tokenizer


def _tokens(moves, src, dst, reason=None) -> int:
    return sum(t.tokens for (s, d, r), t in moves.items() if (s, d) == (src, dst) and reason in (None, r))


def test_ledger_reasons_totals_and_log_lines(make_store, caplog):
    model, tok = tiny_llama(), tiny_tokenizer()
    store = make_store(model, 64, host_capacity=256, chunk_size=8)          # 8 device blocks
    engine = Engine(model, tok, store)
    convs = {f"s{i}": [5 + i, 9, 13, 17, 21, 25, 29, 33] * 4 for i in range(3)}
    with caplog.at_level(logging.INFO, logger="stateful_hf.moves"):
        for _ in range(2):
            for sid in convs:
                out = engine.submit(sid, convs[sid], SamplingParams(max_new_tokens=3)).result()
                convs[sid] = convs[sid] + list(out.token_ids) + [7, 11]
        on_device = [k for k, c in enumerate(store.session("s2").chunks) if c.state.value == "device"]
        assert len(on_device) >= 2
        before = store.residency("s2")
        with pytest.raises(ValueError, match="unknown move reason"):
            store.move("s2", on_device, "host", reason="because")
        assert store.residency("s2") == before
        store.move("s2", on_device[:2], "host")
        store.move("s2", on_device[:1], "device", reason="hint")
        freed = store.evict("s2")
    engine.stop()
    moves, c = store.moves.snapshot(), store.stats().counters
    reasons = {r for _, _, r in moves}
    assert {"step", "explicit", "hint"} <= reasons and (reasons & {"pressure", "ahead"})
    assert _tokens(moves, "device", "host") == c.swapped_out_host
    assert _tokens(moves, "host", "device") == c.swapped_in_host
    assert _tokens(moves, "device", "dropped") + _tokens(moves, "host", "dropped") == c.dropped
    assert _tokens(moves, "device", "host", "explicit") >= 16 and _tokens(moves, "host", "device", "hint") == 8
    if freed:
        assert any(r == "evict" for _, _, r in moves)
    kv_block = store.spec.bytes_per_block
    for (_, dst, _), t in moves.items():
        assert t.bytes == (0 if dst == "dropped" else t.chunks * kv_block) and t.chunks <= t.batches * 8
    lines = [r for r in caplog.records if r.name == "stateful_hf.moves"]
    assert len(lines) == sum(t.batches for t in moves.values())
    assert all(r.event == "tier_move" and r.sessions and r.tokens > 0 for r in lines)
    assert sum(r.tokens for r in lines if (r.src, r.dst) == ("device", "host")) == c.swapped_out_host


def test_layerwise_push_down_is_a_recorded_move(make_store):
    model = tiny_llama()
    store = make_store(model, 256, host_capacity=256, chunk_size=8, layerwise_kv=True)
    engine = Engine(model, tiny_tokenizer(), store)
    engine.submit("w", list(range(3, 40)), SamplingParams(max_new_tokens=2)).result()
    engine.stop()
    on_device = store.residency("w")["device"]
    assert on_device > 0
    with store.lease("w"):                         # a running request's chunks, pushed to host slots
        assert store.offload_layers("w", full=True) > 0
    moves = store.moves.snapshot()
    assert _tokens(moves, "device", "layered", "pressure") == on_device
    assert store.residency("w")["host"] == on_device          # the turn ended: LAYERED became HOST
