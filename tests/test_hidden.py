"""HCache: chunks kept as per-layer hidden states and rebuilt to K/V by projection. Every layout,
alone and mixed with every other chunk state, must give exactly the stateless tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy, seed_of

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import ChunkState
from stateful_hf.cache.hidden.partition import HiddenCosts, min_hidden_layers, plan_layers, predicted_time
from stateful_hf.testing import tiny_llama, tiny_opt

PROFILE = stateful_hf.cache.CostProfile()
ORDER = ["device", "hidden", "host", "disk", "dropped"]   # hidden chunks must come from the device


def hidden_store(make_store, model, tmp_path, **kw):
    kw = {"device_capacity": 2048, "host_capacity": 2048, "disk_dir": tmp_path / "disk", "disk_capacity": 2048,
          "cost_profile": PROFILE, "hidden_states": "always", "hidden_layers": 1, **kw}
    return make_store(model, **kw)


def lay_out(store, sid, layout):
    """Put chunk k in tier layout[k % len(layout)] where the chunk's history allows it."""
    s = store.session(sid)
    want = {k: layout[k % len(layout)] for k in range(len(s.chunks))}
    for tier in ORDER:
        ks = [k for k, t in want.items() if t == tier]
        if tier != "dropped":      # dropped chunks cannot move up: only ids remain
            ks = [k for k in ks if s.chunks[k].state is not ChunkState.DROPPED]
        if tier == "device":       # hidden-to-be chunks go through the device (hidden ones stay)
            ks += [k for k, t in want.items() if t == "hidden" and s.chunks[k].state not in
                   (ChunkState.DROPPED, ChunkState.HIDDEN)]
        if tier == "hidden":       # only chunks whose hidden states were captured can become hidden
            ks = [k for k in ks if s.chunks[k].state is ChunkState.HIDDEN or
                  (s.chunks[k].state is ChunkState.DEVICE and store.hidden.capture.valid[s.chunks[k].loc])]
        store.move(sid, ks, tier)
    store.check_integrity()


def replay_layouts(store, model, oracle, cache, conv, layouts) -> int:
    """For each layout: lay session "a" out so, run a turn (exact against stateless generate), check
    that `last_turn` restored / swapped in / recomputed exactly what each tier held. Returns the
    hidden-state tokens restored in all."""
    restored = 0
    for layout in layouts:
        lay_out(store, "a", layout)
        before = store.residency("a")
        restored += before["hidden"]
        out = greedy(model, conv.ids, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids)), layout
        turn = store.stats("a").last_turn
        assert turn.restored_hidden == before["hidden"] and turn.recomputed_tokens == before["dropped"]
        assert turn.swapped_in_host == before["host"] and turn.swapped_in_disk == before["disk"]
        conv.reply(out)
    return restored


@pytest.mark.parametrize("family,hidden_layers", [("llama", 1), ("mistral", 2), ("qwen2", 1), ("opt", 2),
                                                  ("opt-post-ln", 1), ("opt-proj", 2)])
def test_hidden_alone_and_mixed_is_exact(family, hidden_layers, make_store, tmp_path):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = hidden_store(make_store, model, tmp_path, hidden_layers=hidden_layers)
    cache = store.cache("a")
    conv = Conversation(seed=seed_of(family), first=70, turn=20)
    out = greedy(model, conv.ids, cache=cache)
    conv.reply(out)
    layouts = [["hidden"] * 9, ["hidden", "device", "host", "disk", "dropped"],
               ["dropped", "hidden", "disk", "hidden", "host", "device"], ["hidden"] * 9,
               ["host", "hidden", "dropped", "hidden", "disk"]]
    restored = replay_layouts(store, model, oracle, cache, conv, layouts)
    c = store.stats().counters
    assert c.restored_hidden == restored > 0 and c.restore_seconds > 0 and c.swapped_in_host and c.recomputed


def test_engine_restores_hidden_chunks_in_its_steps(make_store):
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = make_store(model, device_capacity=1024, host_capacity=1024, cost_profile=PROFILE,
                       hidden_states="always", hidden_layers=1)
    engine = Engine(model, store=store, max_batch_tokens=48).start()   # prefills span several steps
    try:
        convs = {f"s{i}": Conversation(seed=30 + i, first=40 + 9 * i) for i in range(3)}
        for turn in range(3):
            handles = {sid: engine.submit(sid, c.ids[0].tolist(), SamplingParams(max_new_tokens=6))
                       for sid, c in convs.items()}
            for sid, h in handles.items():
                ids = convs[sid].ids[0].tolist()
                got = list(h.result(timeout=300).token_ids)
                x = torch.tensor([ids])
                assert got == greedy(oracle, x, 6)[0, len(ids):].tolist(), (turn, sid)
                convs[sid].reply(torch.tensor([ids + got]))
            for i, sid in enumerate(convs):          # every other chunk (or all) to hidden states
                s = store.session(sid)
                store.move(sid, [k for k in range(len(s.chunks)) if (k + i + turn) % 2 == 0 or turn == 1], "hidden")
        assert store.stats().counters.restored_hidden > 0
    finally:
        engine.stop()


def test_abort_puts_unfinished_restores_back(make_store):
    model = FAMILIES["qwen2"]()
    store = make_store(model, host_capacity=512, cost_profile=PROFILE, hidden_states="always", hidden_layers=2)
    greedy(model, torch.arange(3, 80)[None], n=4, cache=store.cache("a"))
    n = store.session("a").num_tokens
    store.move("a", [0, 1], "hidden")
    step = store.plan_step([("a", [5], [n])])
    assert store.session("a").chunks[0].source is not None
    store.check_integrity()
    store.abort(step)                       # no forward ran: the chunks are hidden again, nothing lost
    assert [c.state for c in store.session("a").chunks[:2]] == [ChunkState.HIDDEN] * 2
    store.check_integrity()
    store.move("a", [0], "device")          # a restore outside a step (all layers at once)
    assert store.session("a").chunks[0].state is ChunkState.DEVICE and store.session("a").chunks[0].source is None


def test_auto_keeps_hidden_for_mha_and_kv_for_gqa(make_store):
    mha = tiny_llama("llama", num_hidden_layers=12, num_key_value_heads=4)
    store = make_store(mha, device_capacity=1024, host_capacity=1024, cost_profile=PROFILE, hidden_states="auto")
    plan = store.hidden_plan                # measured costs of this machine, under the 0.55 budget
    assert plan is not None and plan.hidden_layers >= 11 and plan.complement == "kv"
    for i in range(3):
        greedy(mha, torch.arange(3, 131)[None] + i, n=1, cache=store.cache(f"s{i}"))   # 128 tokens: 4 chunks
        store.evict(f"s{i}")                # the policy moves them down: as hidden states
    st = store.stats()
    assert st.hidden_tokens == st.host_tokens == 3 * 128
    assert st.host_bytes / st.host_tokens <= 0.55 * st.kv_bytes_per_token, st
    assert st.bytes_per_token["host"] == st.hidden_bytes_per_token
    assert "as hidden states" in store.summary()
    # no budget and K/V restores fastest (the serial CPU case): "auto" keeps K/V and captures nothing,
    # so the planner's choice costs what pure K/V costs; "always" keeps a hidden tier of 0 hidden layers
    fast_kv = HiddenCosts(io_hidden=1.0, io_kv=0.1, c_hidden=2.0, c_token=20.0, overlap=False)
    mha2 = tiny_llama("llama", num_hidden_layers=12, num_key_value_heads=4)
    auto = make_store(mha2, host_capacity=256, cost_profile=PROFILE, hidden_states="auto", hidden_budget=None,
                      hidden_costs=fast_kv)
    assert auto.hidden_plan.hidden_layers == 0 and auto.tiers.hidden is None and auto.hidden.capture is None
    always = make_store(tiny_llama("llama", num_hidden_layers=12, num_key_value_heads=4), host_capacity=256,
                        cost_profile=PROFILE, hidden_states="always", hidden_budget=None, hidden_costs=fast_kv)
    assert always.hidden_plan.hidden_layers == 0 and always.tiers.hidden is not None
    gqa = tiny_llama("llama", num_key_value_heads=1)       # K+V (32 values) smaller than hidden (64)
    kv_store = make_store(gqa, host_capacity=256, cost_profile=PROFILE, hidden_states="auto")
    assert kv_store.tiers.hidden is None and kv_store.hidden.capture is None
    greedy(gqa, torch.arange(3, 70)[None], n=1, cache=kv_store.cache("g"))
    kv_store.evict("g")
    assert kv_store.stats().hidden_tokens == 0 and kv_store.stats().host_tokens > 0
    with pytest.raises(ValueError, match="hidden_states='always'"):
        kv_store.move("g", [0], "hidden")


def test_hidden_errors_are_clear(make_store):
    model = FAMILIES["opt"]()
    never = make_store(model, host_capacity=256, cost_profile=PROFILE)
    greedy(model, torch.arange(3, 70)[None], n=2, cache=never.cache("a"))
    step = never.plan_step([("a", [5], [never.session("a").num_tokens])])
    assert step.hidden is None               # nothing is captured when hidden states are unused
    never.abort(step)
    with pytest.raises(ValueError, match="keeps no hidden states"):
        never.move("a", [0], "hidden")
    with pytest.raises(ValueError, match="hidden_states must be"):
        make_store(model, cost_profile=PROFILE, hidden_states="sometimes")
    with pytest.raises(ValueError, match="needs room"):
        make_store(model, cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    store = make_store(model, host_capacity=256, cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    greedy(model, torch.arange(3, 70)[None], n=2, cache=store.cache("a"))
    store.move("a", [0], "host")
    with pytest.raises(ValueError, match="only device chunks"):
        store.move("a", [0], "hidden")
    store.move("a", [1], "hidden")
    with pytest.raises(ValueError, match="move to the device"):
        store.move("a", [1], "host")


def test_capture_needs_no_second_forward():
    model = tiny_opt()
    calls = []
    model.base_model.decoder.layers[0].register_forward_hook(lambda *a: calls.append(1))
    store = stateful_hf.SessionStore(model, host_capacity=256, cost_profile=PROFILE, hidden_states="always",
                                     hidden_layers=2)
    greedy(model, torch.arange(3, 40)[None], n=3, cache=store.cache("a"))
    assert len(calls) == 3                   # prefill + 2 decode steps: one forward each
    assert store.hidden.capture.valid[store.session("a").chunks[0].loc]


def test_planner_closed_forms():
    # compute-bound on a GPU (overlap): pair with KV; L_H = ceil(N * IO_KV / (IO_KV + C_H - IO_H))
    c = HiddenCosts(io_hidden=1.0, io_kv=2.0, c_hidden=1.2, c_token=8.0, overlap=True)
    p = plan_layers(c, 32)
    assert p.complement == "kv" and p.hidden_layers == -(-32 * 2 // 2.2)
    assert p.predicted <= min(p.pure_hidden, p.pure_other)
    # I/O-bound: pair with token recompute; L_H = ceil(N * C_tok / (C_tok + IO_H - C_H))
    c = HiddenCosts(io_hidden=1.0, io_kv=2.0, c_hidden=0.3, c_token=3.0, overlap=True)
    p = plan_layers(c, 48)
    assert p.complement == "recompute" and p.hidden_layers == -(-48 * 3.0 // 3.7)
    assert p.predicted <= min(p.pure_hidden, p.pure_other)
    # serial (CPU): time adds up, so an end point wins; a storage floor is honoured at its cost
    c = HiddenCosts(io_hidden=0.1, io_kv=0.2, c_hidden=5.0, c_token=30.0, overlap=False)
    assert plan_layers(c, 12, complement="kv").hidden_layers == 0
    floor = min_hidden_layers(0.55, 12, 768, 2 * 768)
    assert floor == 11
    p = plan_layers(c, 12, complement="kv", min_hidden=floor)
    assert p.hidden_layers == 11 and p.predicted == predicted_time(c, 12, 11, "kv")
    assert min_hidden_layers(0.55, 12, 64, 64) == 0          # GQA: the budget cannot be met
    with pytest.raises(ValueError):
        HiddenCosts(io_hidden=0, io_kv=1, c_hidden=1, c_token=1, overlap=False)
