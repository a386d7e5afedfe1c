"""Qwen3, Gemma 3 (text), Gemma 2 and Phi-3: exact against stateless generate over multi-turn chats
with every chunk state (device, host, disk, dropped, hidden states), in the engine, in the virtual
layout and with layer-wise KV; the adapter's refusals and its per-layer windows."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import Conversation, engine_round, greedy, seed_of
from test_hidden import replay_layouts

import stateful_hf
from stateful_hf import Engine
from stateful_hf.cache import CostProfile
from stateful_hf.integration.adapter import adapter_for
from stateful_hf.integration.hooks import run_step
from stateful_hf.testing import TINY_FAMILIES, tiny_gemma3, tiny_phi3

PROFILE = CostProfile()
NEW = sorted(TINY_FAMILIES)
_MODELS: dict = {}


def models(family):
    """(model, oracle): two identically seeded copies, made once per test session."""
    if family not in _MODELS:
        _MODELS[family] = (TINY_FAMILIES[family](), TINY_FAMILIES[family]())
    return _MODELS[family]


@pytest.mark.parametrize("family", NEW)
def test_every_tier_and_hidden_states_exact(family, make_store, tmp_path):
    """Chunks laid out over device / hidden / host / disk / dropped between turns; every layer
    (sliding and global) kept as hidden states, so the projection rebuilds both kinds."""
    model, oracle = models(family)
    store = make_store(model, device_capacity=2048, host_capacity=2048, disk_dir=tmp_path / "disk",
                       disk_capacity=2048, cost_profile=PROFILE, hidden_states="always", hidden_layers=2)
    cache = store.cache("a")
    conv = Conversation(seed=seed_of(family), first=70, turn=20)
    conv.reply(greedy(model, conv.ids, cache=cache))
    layouts = [["hidden"] * 9, ["host"] * 9, ["disk"] * 9, ["dropped"] * 9,
               ["dropped", "hidden", "disk", "hidden", "host", "device"]]
    replay_layouts(store, model, oracle, cache, conv, layouts)
    c = store.stats().counters
    assert c.restored_hidden and c.swapped_in_host and c.swapped_in_disk and c.recomputed


@pytest.mark.parametrize("family", NEW)
def test_engine_exact_with_pressure_and_hidden_states(family, make_store):
    """Three sessions through the engine's mixed steps (prefill spans steps, 48-token budget) with a
    small device pool; between rounds chunks go to hidden states and the host or are dropped."""
    model, oracle = models(family)
    store = make_store(model, device_capacity=256, host_capacity=1024, cost_profile=PROFILE,
                       hidden_states="always", hidden_layers=1)
    convs = {f"{family}{i}": Conversation(seed=40 + i, first=30 + 11 * i, turn=9) for i in range(3)}
    with Engine(model, store=store, max_batch_tokens=48) as engine:
        for turn in range(3):
            engine_round(engine, convs, oracle, n=5)
            for i, sid in enumerate(convs):
                s = store.session(sid)
                tier = ("hidden", "host", "dropped")[(i + turn) % 3]
                ks = [k for k in range(len(s.chunks)) if k % 2 == turn % 2 and s.chunks[k].state.name == "DEVICE"]
                if tier == "hidden":
                    ks = [k for k in ks if store.hidden.capture.valid[s.chunks[k].loc]]
                store.move(sid, ks, tier)
    c = store.stats().counters
    assert c.restored_hidden and c.recomputed


@pytest.mark.parametrize("family", NEW)
def test_virtual_layout_and_layerwise_kv_exact(family, make_store):
    """The dense kernels (virtual layout) and LayerKV's layer-wise residency honour the per-layer
    windows, scaling and softcap too."""
    model, oracle = models(family)
    virtual = make_store(model, device_capacity=4096, layout="virtual", max_context=512, cost_profile=PROFILE)
    conv = Conversation(seed=seed_of(family) + 1, first=50, turn=12)
    for _ in range(3):
        out = greedy(model, conv.ids, n=6, cache=virtual.cache("v"))
        assert torch.equal(out, greedy(oracle, conv.ids, n=6))
        conv.reply(out)
    layered = make_store(model, 128, chunk_size=16, host_capacity=4096, cost_profile=PROFILE, layerwise_kv=True,
                         attn_backend="torch")
    convs = {f"L{i}": Conversation(seed=60 + i, first=40 + 13 * i, turn=8) for i in range(3)}
    with Engine(model, store=layered, max_batch_tokens=64) as engine:
        for _ in range(2):
            engine_round(engine, convs, oracle, n=5)
    assert layered.stats().counters.swapped_in_host


def test_projection_picks_each_layers_rotary_and_k_norm():
    """The HCache projection equals the K the attention itself sees, per layer (Gemma 3's sliding
    layer 0 has RoPE base 10^4, its global layer 1 base 10^6; both apply k_norm)."""
    from stateful_hf.integration.projector import kv_projector

    model = tiny_gemma3()
    adapter = adapter_for(model)
    seen = {}

    def grab(layer):
        def hook(module, args, kwargs):
            seen[layer] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(grab(i), with_kwargs=True)
    keys = {}
    originals = {}
    for i, layer in enumerate(model.model.layers):
        originals[i] = layer.self_attn.k_norm.forward

        def wrapped(x, i=i):
            keys[i] = originals[i](x)
            return keys[i]
        layer.self_attn.k_norm.forward = wrapped
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        cos_sin = {t: model.model.rotary_emb(torch.zeros(1), torch.arange(57)[None], t)
                   for t in ("sliding_attention", "full_attention")}
        model(ids)
        project = kv_projector(model, adapter)
        apply = __import__(type(model.model.layers[0].self_attn).__module__, fromlist=["x"]).apply_rotary_pos_emb
        forward_keys = dict(keys)                  # [1, Hkv, T, hd] after k_norm, before RoPE
        for i, kind in enumerate(model.config.layer_types):
            k, _ = project(i, seen[i][0], torch.arange(57))
            want = apply(forward_keys[i], forward_keys[i], *cos_sin[kind])[1][0].transpose(0, 1)   # [T, Hkv, hd]
            torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)
            other = cos_sin["full_attention" if kind == "sliding_attention" else "sliding_attention"]
            wrong = apply(forward_keys[i], forward_keys[i], *other)[1][0].transpose(0, 1)
            assert not torch.allclose(k, wrong, atol=1e-3)


def test_final_logit_softcap_in_engine_steps(make_store):
    """Engine logits (run_step) carry Gemma 2's final softcap, as its own forward does (sampling
    would otherwise see other probabilities; greedy cannot tell)."""
    model, oracle = models("gemma2")
    store = make_store(model, cost_profile=PROFILE)
    ids = torch.arange(3, 40).tolist()
    store.open("s")
    step = store.plan_step([("s", ids, list(range(len(ids))))])
    with torch.no_grad():
        logits = run_step(model, step, step.last_rows())
    store.commit(step)
    with torch.no_grad():
        want = oracle(torch.tensor([ids])).logits[0, -1:]
        plain = model(torch.tensor([ids])).logits[0, -1:]     # the enabled model without a step: softcapped too
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-4)
    assert logits.abs().max() <= 5.0


def test_adapter_windows_and_refusals():
    assert adapter_for(tiny_gemma3()).layer_windows == (24, None)
    assert adapter_for(tiny_phi3()).layer_windows == (24, 24)
    assert adapter_for(models("qwen3")[0]).layer_windows == (None, None)
    qwen3_sw = TINY_FAMILIES["qwen3"](use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert adapter_for(qwen3_sw).layer_windows == (None, 16)
    with pytest.raises(stateful_hf.UnsupportedModelError, match="bidirectional"):
        adapter_for(tiny_gemma3(use_bidirectional_attention=True))
    longrope = tiny_phi3(max_position_embeddings=4096, original_max_position_embeddings=1024,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    assert adapter_for(longrope).max_positions == 1024       # held where its rotation does not change
    config = transformers.Gemma3Config(text_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                        vocab_size=64),
                                       vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                                          num_attention_heads=2, image_size=28, patch_size=14))
    with pytest.raises(stateful_hf.UnsupportedModelError, match="Gemma3ForCausalLM"):
        adapter_for(transformers.Gemma3ForConditionalGeneration(config))


def test_a_window_the_store_does_not_know_is_refused(make_store):
    """If the model's attention passes another window than the store was made for (a stale adapter),
    the step fails with a clear error instead of attending wrongly; the session is intact."""
    model = tiny_gemma3()
    store = make_store(model, cost_profile=PROFILE)
    cache = store.cache("a")
    out = greedy(model, torch.arange(3, 40)[None], n=3, cache=cache)
    before = list(store.session("a").token_ids)
    model.model.layers[0].self_attn.sliding_window = 8
    with pytest.raises(RuntimeError, match="sliding_window=8"):
        greedy(model, torch.cat([out, torch.arange(5, 15)[None]], 1), n=3, cache=cache)
    assert list(store.session("a").token_ids) == before
    model.model.layers[0].self_attn.sliding_window = 24
    assert torch.equal(greedy(model, out, n=3, cache=cache), greedy(tiny_gemma3(), out, n=3))


@pytest.mark.parametrize("family", NEW)
def test_enabled_model_without_a_stateful_cache_still_matches(family, make_store):
    """Ordinary calls of an enabled model (no step: SDPA, or the softcapped path) stay the model's own,
    left padding included."""
    model, oracle = models(family)
    make_store(model, cost_profile=PROFILE)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy(model, ids), greedy(oracle, ids))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, ids.shape[1])], 1).long()
    assert torch.equal(greedy(model, padded, attention_mask=mask), greedy(oracle, padded, attention_mask=mask))


@pytest.mark.parametrize("family,overrides,windows", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), (None, 16)),
    ("mistral", dict(sliding_window=20), (20, 20)),
])
def test_older_families_with_sliding_windows_exact(family, overrides, windows, make_store):
    """Qwen2's mixed layer types (sliding from max_window_layers on) and Mistral's window, per layer."""
    from stateful_hf.testing import tiny_llama

    model, oracle = tiny_llama(family, **overrides), tiny_llama(family, **overrides)
    store = make_store(model, device_capacity=1024, host_capacity=1024, cost_profile=PROFILE)
    assert store.adapter.layer_windows == windows
    cache = store.cache("a")
    conv = Conversation(seed=seed_of(family), first=60, turn=15)
    for tier in ("device", "host", "dropped"):
        store.move("a", list(range(len(store.session("a").chunks))), tier)
        out = greedy(model, conv.ids, n=6, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids, n=6)), tier
        conv.reply(out)
